//! Profiling aid: `locked_update` in a loop on in-memory SQLite (used for BENCHMARKS.md).
//! `cargo run --release --example profile_locked_update -- [iterations] [hand]`

use std::{sync::Arc, time::Instant};

use entity::node;
use freshlock::{LocalLock, Session};
use migration::{Migrator, MigratorTrait};
use sea_orm::{
    ConnectOptions, Database, EntityTrait, IntoActiveModel, Set, SqliteTransactionMode,
    TransactionOptions, TransactionTrait,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let iterations: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let hand = args.iter().any(|a| a == "hand");
    let current = args.iter().any(|a| a == "current");
    let runtime = if current {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    }
    .expect("runtime");
    runtime.block_on(async move {
        let mut options = ConnectOptions::new("sqlite::memory:");
        options
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .sqlx_logging(false);
        let db = Database::connect(options).await.expect("connect");
        Migrator::up(&db, None).await.expect("migrate");
        node::Entity::insert(node::ActiveModel {
            id: Set(1),
            title: Set("n".into()),
            ..Default::default()
        })
        .exec(&db)
        .await
        .expect("seed");
        let session = Session::builder(db.clone())
            .lock(Arc::new(LocalLock::new()))
            .build()
            .expect("session");
        let nodes = session.repository::<node::Entity>();
        let started = Instant::now();
        for _ in 0..iterations {
            if hand {
                let txn = db
                    .begin_with_options(TransactionOptions {
                        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                        ..Default::default()
                    })
                    .await
                    .expect("begin");
                let model = node::Entity::find_by_id(1)
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
            } else {
                nodes
                    .locked_update(1, |n| {
                        let score = n.score.as_ref().unwrap_or(0);
                        n.score = Set(Some(score + 1));
                        Ok(())
                    })
                    .await
                    .expect("update");
            }
        }
        let per = started.elapsed().as_secs_f64() * 1e6 / iterations as f64;
        println!(
            "{} {:.1} µs/op",
            if hand {
                "hand-written"
            } else {
                "locked_update"
            },
            per
        );
    });
}
