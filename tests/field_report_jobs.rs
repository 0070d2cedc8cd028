//! The Django report's tasks as the demo runs them with keyed jobs (`workload::django::jobs`):
//! claimed under a lease, the heavy work outside any transaction, a short fenced finish. While a
//! job's heavy work runs, another writer writes at once — on SQLite, where a transaction held
//! open around the work would hold the whole database — and every task is done exactly once.

mod common;

use std::time::Duration;

use entity::ham;
use freshlock::{
    Session,
    jobs::{JobOutcome, Worker},
};
use migration::{Migrator, MigratorTrait};
use sea_orm::{
    ConnectOptions, Database, DatabaseConnection, EntityTrait, Set, SqliteTransactionMode,
    TransactionOptions, TransactionTrait,
};
use tokio::sync::{mpsc, watch};
use workload::django;

/// A pool on the SQLite file at `path` whose writers give up at once when another holds the
/// database (no busy wait): a write that had to wait fails instead.
async fn impatient(path: &std::path::Path) -> DatabaseConnection {
    let mut options = ConnectOptions::new(format!("sqlite://{}?mode=rwc", path.display()));
    options.max_connections(1).sqlx_logging(false);
    options.map_sqlx_sqlite_opts(|o| o.busy_timeout(Duration::ZERO));
    Database::connect(options).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_jobs_hold_nothing_during_heavy_work() {
    const SPAMS: i32 = 4;
    let dir = std::env::temp_dir().join(format!("freshlock-field-jobs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("jobs.db");
    let db = Database::connect(format!("sqlite://{}?mode=rwc", path.display()))
        .await
        .unwrap();
    Migrator::up(&db, None).await.unwrap();
    django::seed(&db, SPAMS).await.unwrap();
    let added = django::enqueue(&db, SPAMS).await.unwrap();
    assert_eq!(
        added, SPAMS as u32,
        "every Spam once; its second delivery a duplicate"
    );

    // The heavy work says it started, then waits to be let go.
    let (started, mut working) = mpsc::unbounded_channel();
    let (let_go, gate) = watch::channel(false);
    let work = move |spam: i32| {
        let (started, mut gate) = (started.clone(), gate.clone());
        async move {
            let _ = started.send(spam);
            let _ = gate.wait_for(|open| *open).await;
        }
    };
    let (processed, mut finished) = mpsc::unbounded_channel();
    let worker = Worker::new(Session::new(db.clone()), django::jobs(work, processed));
    let running = tokio::spawn(async move { worker.run_until_idle().await });

    let spam = working.recv().await.expect("a job's heavy work started");
    // Mid-work, the Ham updater writes without waiting for anything.
    let other = impatient(&path).await;
    let txn = other
        .begin_with_options(TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..Default::default()
        })
        .await
        .expect("no transaction is held during the heavy work");
    ham::Entity::update(ham::ActiveModel {
        id: Set(1),
        name: Set("ham 1 (edited)".into()),
        ..Default::default()
    })
    .exec(&txn)
    .await
    .unwrap();
    txn.commit().await.unwrap();
    assert!(
        finished.try_recv().is_err(),
        "spam {spam} is not finished yet"
    );

    let_go.send(true).unwrap();
    let runs = running.await.unwrap().unwrap();
    let completed = (runs.iter())
        .filter(|run| run.outcome == JobOutcome::Completed)
        .count();
    assert_eq!(completed, SPAMS as usize, "every job acknowledged once");
    assert_eq!(
        django::done(&db).await.unwrap(),
        SPAMS as u64,
        "and in the rows"
    );
    assert_eq!(django::processed_twice(&db).await.unwrap(), 0);
    let mut ends = 0;
    while finished.try_recv().is_ok() {
        ends += 1;
    }
    assert_eq!(ends, SPAMS);
    let ham = ham::Entity::find_by_id(1).one(&db).await.unwrap().unwrap();
    assert_eq!(ham.name, "ham 1 (edited)");
    db.close().await.unwrap();
    other.close().await.unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
