//! Criterion benchmarks of the two core costs on in-memory SQLite, each beside its baseline:
//! a cached `load` vs sea-orm's `find_by_id`, and `locked_update` (in-process lock) vs the
//! minimal hand-written transaction (BEGIN IMMEDIATE, SELECT, UPDATE, COMMIT).
//!
//! `cargo bench --bench core`. The interleaved ratios are in `benches/scenarios.rs`.

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use entity::node;
use freshlock::Session;
use freshlock::lock::LocalLock;
use sea_orm::{DatabaseConnection, EntityTrait};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

mod common;

async fn database() -> DatabaseConnection {
    common::database("sqlite::memory:", 2, 1).await
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
    let mut group = c.benchmark_group("update");
    group.bench_function("freshlock locked_update", |b| {
        b.to_async(&rt).iter(|| common::increment(&session, 1))
    });
    group.bench_function("hand-written transaction", |b| {
        b.to_async(&rt).iter(|| common::hand_written(&db, 2))
    });
    group.finish();
}

criterion_group!(benches, load, update);
criterion_main!(benches);
