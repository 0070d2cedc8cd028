//! `SessionBuilder::optimistic_first`: one guarded statement when the cached row is current, the
//! locked path when it is not — never a lost update.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};

use entity::node;
use freshlock::lock::LocalLock;
use freshlock::{Session, UpdateOutcome};
use sea_orm::{DatabaseConnection, Set};
use servers::{TestDb, databases};
use tokio::sync::Barrier;

fn optimistic(db: &DatabaseConnection, lock: &LocalLock) -> Session {
    Session::builder(db.clone())
        .lock(Arc::new(lock.clone()))
        .version_column::<node::Entity>(node::Column::Changed)
        .optimistic_first(true)
        .build()
        .unwrap()
}

fn bump(n: &mut node::ActiveModel) -> Result<(), freshlock::ApplyError> {
    let score = n.score.as_ref().unwrap_or(0);
    n.score = Set(Some(score + 1));
    Ok(())
}

#[tokio::test]
async fn one_statement_when_the_cached_row_is_current() {
    let (db, recorder) = common::memory_db_recorded().await;
    common::seed_nodes(&db, 1).await;
    let session = optimistic(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    nodes.load(1).await.unwrap();
    for expected in 1..=3 {
        recorder.clear();
        let report = nodes.locked_update(1, bump).await.unwrap();
        let UpdateOutcome::Updated(model) = &report.outcome else {
            panic!("{:?}", report.outcome);
        };
        assert_eq!(model.score, Some(expected));
        assert!(
            !report.lock.held && report.lock.tries == 0,
            "no lock was taken"
        );
        let sent = recorder.statements();
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert!(sent[0].starts_with("UPDATE"), "{sent:?}");
    }
    assert_eq!(common::node_in_db(&db, 1).await.score, Some(3));
    assert_eq!(
        common::node_in_db(&db, 1).await.changed,
        3,
        "the version moved each time"
    );
}

/// A concurrent section of the same session evicts the cached row while `apply` runs on it (here
/// `apply` clears the cache itself, deterministically): the one-statement write still goes out,
/// checked against the row `apply` saw — not an error for want of a snapshot.
#[tokio::test]
async fn the_snapshot_evicted_while_apply_runs_is_still_the_guard() {
    let db = common::memory_db().await;
    common::seed_nodes(&db, 1).await;
    let session = optimistic(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    nodes.load(1).await.unwrap();
    let evicting = session.clone();
    let report = nodes
        .locked_update(1, move |n| {
            evicting.clear_cache();
            bump(n)
        })
        .await
        .expect("written, not NoSnapshot");
    assert!(report.outcome.is_updated());
    assert!(!report.lock.held, "the one-statement path wrote it");
    assert_eq!(common::node_in_db(&db, 1).await.score, Some(1));
}

#[tokio::test]
async fn a_stale_cached_row_takes_the_locked_path() {
    let db = common::memory_db().await;
    common::seed_nodes(&db, 1).await;
    let lock = LocalLock::new();
    let (a, b) = (optimistic(&db, &lock), optimistic(&db, &lock));
    a.repository::<node::Entity>().load(1).await.unwrap();
    // B writes after A cached the row: A's snapshot is stale.
    b.repository::<node::Entity>()
        .locked_update(1, |n| {
            n.score = Set(Some(10));
            Ok(())
        })
        .await
        .unwrap();
    let report = a
        .repository::<node::Entity>()
        .locked_update(1, bump)
        .await
        .unwrap();
    assert!(report.outcome.is_updated());
    assert!(
        report.lock.held,
        "the refused optimistic write went on under the lock"
    );
    assert_eq!(
        common::node_in_db(&db, 1).await.score,
        Some(11),
        "B's write kept"
    );

    // Without a version column the locked path runs at once.
    let plain = Session::builder(db.clone())
        .lock(Arc::new(lock.clone()))
        .optimistic_first(true)
        .build()
        .unwrap();
    let nodes = plain.repository::<node::Entity>();
    nodes.load(1).await.unwrap();
    let report = nodes.locked_update(1, bump).await.unwrap();
    assert!(report.lock.held);
    assert_eq!(common::node_in_db(&db, 1).await.score, Some(12));
}

/// 4 sessions (each with its own cache) × 2 tasks × 40 increments of one row: the optimistic
/// writes that find the row moved fall back to the lock; the counter equals the acknowledged
/// increments.
async fn storm(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let lock = LocalLock::new();
    let acknowledged = Arc::new(AtomicU32::new(0));
    let optimistic_writes = Arc::new(AtomicU32::new(0));
    let start = Arc::new(Barrier::new(8));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let session = optimistic(&db.db, &lock);
        for _ in 0..2 {
            let session = session.clone();
            let (acknowledged, optimistic_writes, start) = (
                Arc::clone(&acknowledged),
                Arc::clone(&optimistic_writes),
                Arc::clone(&start),
            );
            tasks.push(tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                start.wait().await;
                for _ in 0..40 {
                    nodes.load(1).await.unwrap();
                    let report = nodes.locked_update(1, bump).await.unwrap();
                    assert!(report.outcome.is_updated());
                    acknowledged.fetch_add(1, Ordering::SeqCst);
                    if !report.lock.held {
                        optimistic_writes.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let counter = db.score(1).await.unwrap_or(0) as u32;
    eprintln!(
        "{} acknowledged ({} optimistic), counter {counter}",
        acknowledged.load(Ordering::SeqCst),
        optimistic_writes.load(Ordering::SeqCst)
    );
    assert_eq!(counter, acknowledged.load(Ordering::SeqCst));
    assert!(optimistic_writes.load(Ordering::SeqCst) > 0);
}

servers::server_tests! {
    storm_sqlite: storm, (), sqlite;
    storm_postgres: storm, (), postgres;
    storm_mysql: storm, (), mysql;
}
