//! Criterion benchmarks of the two core costs on in-memory SQLite, each beside its baseline:
//! a cached `load` vs sea-orm's `find_by_id`, and `locked_update` (in-process lock) vs the
//! minimal hand-written transaction (BEGIN IMMEDIATE, SELECT, UPDATE, COMMIT).
//!
//! `cargo bench --bench core`. The interleaved ratios are in `benches/scenarios.rs`.

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use entity::node;
use freshlock::{LocalLock, Session};
use migration::{Migrator, MigratorTrait};
use sea_orm::{
    ConnectOptions, Database, DatabaseConnection, EntityTrait, IntoActiveModel, Set,
    SqliteTransactionMode, TransactionOptions, TransactionTrait,
};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn database() -> DatabaseConnection {
    let mut options = ConnectOptions::new("sqlite::memory:");
    options
        .max_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .sqlx_logging(false);
    let db = Database::connect(options).await.expect("connect");
    Migrator::up(&db, None).await.expect("migrate");
    for id in 1..=2 {
        node::Entity::insert(node::ActiveModel {
            id: Set(id),
            title: Set(format!("node {id}")),
            ..Default::default()
        })
        .exec(&db)
        .await
        .expect("seed");
    }
    db
}

fn load(c: &mut Criterion) {
    let rt = runtime();
    let db = rt.block_on(database());
    let session = Session::new(db.clone());
    let nodes = session.repository::<node::Entity>();
    rt.block_on(nodes.load(1)).expect("load");
    let mut group = c.benchmark_group("load");
    group.bench_function("freshlock cached load", |b| {
        b.to_async(&rt)
            .iter(|| async { nodes.load(1).await.expect("hit") })
    });
    group.bench_function("sea-orm find_by_id", |b| {
        b.to_async(&rt)
            .iter(|| async { node::Entity::find_by_id(1).one(&db).await.expect("find") })
    });
    group.finish();
}

fn update(c: &mut Criterion) {
    let rt = runtime();
    let db = rt.block_on(database());
    let session = Session::builder(db.clone())
        .lock(Arc::new(LocalLock::new()))
        .build()
        .expect("session");
    let nodes = session.repository::<node::Entity>();
    let mut group = c.benchmark_group("update");
    group.bench_function("freshlock locked_update", |b| {
        b.to_async(&rt).iter(|| async {
            nodes
                .locked_update(1, |n| {
                    let score = n.score.as_ref().unwrap_or(0);
                    n.score = Set(Some(score + 1));
                    Ok(())
                })
                .await
                .expect("update")
        })
    });
    group.bench_function("hand-written transaction", |b| {
        b.to_async(&rt).iter(|| async {
            let txn = db
                .begin_with_options(TransactionOptions {
                    sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                    ..Default::default()
                })
                .await
                .expect("begin");
            let model = node::Entity::find_by_id(2)
                .one(&txn)
                .await
                .expect("select")
                .expect("row");
            let score = model.score.unwrap_or(0);
            let mut am = model.into_active_model();
            am.score = Set(Some(score + 1));
            node::Entity::update(am)
                .exec_without_returning(&txn)
                .await
                .expect("update");
            txn.commit().await.expect("commit");
        })
    });
    group.finish();
}

criterion_group!(benches, load, update);
criterion_main!(benches);
