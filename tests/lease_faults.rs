//! Lease faults: a release that fails after the commit, a lease lost before the write, lease
//! expiry by the database clock.

mod common;

use std::{sync::Arc, time::Duration};

use common::{
    FakeLock, memory_db, node_in_db, seed_nodes, session_trying_twice as session_with, set_score,
};
use entity::node;
use freshlock::lock::backend::LeaseLock;
use freshlock::lock::{LockName, TableLock};
use freshlock::{LockError, OnLockFailure, UpdateOutcome};
use sea_orm::{ConnectionTrait, Statement};

#[tokio::test]
async fn a_release_that_fails_after_commit_keeps_the_update_and_says_so() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let fake = FakeLock::new();
    fake.fail_release(true);
    let session = session_with(&db, Arc::new(fake), OnLockFailure::Fail);
    let report = session
        .repository::<node::Entity>()
        .locked_update(1, set_score(5))
        .await
        .expect("a failed release does not turn a commit into an error");
    assert!(report.outcome.is_updated());
    assert!(report.lock.held);
    let error = report
        .lock
        .release_error
        .expect("the failed release is reported");
    assert!(
        matches!(
            error.error(),
            LockError::Backend {
                backend: "fake",
                ..
            }
        ),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("fake lock backend failed"),
        "{error}"
    );
    assert_eq!(node_in_db(&db, 1).await.score, Some(5));
}

#[tokio::test]
async fn a_lost_lease_refuses_the_write() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let fake = FakeLock::new();
    fake.lose_lease(true);
    let session = session_with(&db, Arc::new(fake), OnLockFailure::Fail);
    let nodes = session.repository::<node::Entity>();
    let report = nodes.locked_update(1, set_score(5)).await.unwrap();
    assert!(matches!(report.outcome, UpdateOutcome::LeaseLost));
    assert_eq!(node_in_db(&db, 1).await.score, None, "nothing written");
    assert_eq!(session.cache_stats().len, 0);
}

/// `locked_update_many` checks its leases before its first UPDATE, as `locked_update` does:
/// a lost lease sends no UPDATE at all (the section it ran as before checked at the commit,
/// after writing every row), and nothing is written or cached.
#[tokio::test]
async fn a_lost_lease_refuses_a_many_row_write_before_any_update() {
    let (db, recorder) = common::memory_db_recorded().await;
    seed_nodes(&db, 2).await;
    let fake = FakeLock::new();
    fake.lose_lease(true);
    let session = session_with(&db, Arc::new(fake), OnLockFailure::Fail);
    recorder.clear();
    let report = session
        .repository::<node::Entity>()
        .locked_update_pair(1, 2, |a, b| {
            set_score(5)(a)?;
            set_score(6)(b)
        })
        .await
        .unwrap();
    assert!(
        (report.outcomes.iter()).all(|o| matches!(o, UpdateOutcome::LeaseLost)),
        "{:?}",
        report.outcomes
    );
    assert_eq!(recorder.count("UPDATE"), 0, "{:?}", recorder.statements());
    assert_eq!(node_in_db(&db, 1).await.score, None, "nothing written");
    assert_eq!(node_in_db(&db, 2).await.score, None, "nothing written");
    assert_eq!(session.cache_stats().len, 0);
}

#[tokio::test]
async fn lease_expiry_follows_the_database_clock() {
    let db = memory_db().await;
    let lock = TableLock::new(db.clone()).with_label("clock test");
    let name = LockName::new("clock:1").unwrap();
    let db_now = || async {
        let row = db
            .query_one_raw(Statement::from_string(
                db.get_database_backend(),
                "SELECT CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER) AS now",
            ))
            .await
            .unwrap()
            .unwrap();
        row.try_get::<i64>("", "now").unwrap()
    };
    // Another worker, whatever its own clock says, holds a lease the database says runs an hour.
    let until = db_now().await + 3_600_000;
    db.execute_unprepared(&format!(
        "INSERT INTO freshlock_lock (name, owner, fence, expires_at) VALUES ('clock:1', 'other', 7, {until})"
    ))
    .await
    .unwrap();
    assert!(
        lock.acquire(&name, Duration::ZERO, Duration::from_secs(60))
            .await
            .unwrap()
            .is_none()
    );

    // The database says it has expired: it is taken over, with the next fence.
    let past = db_now().await - 1;
    db.execute_unprepared(&format!("UPDATE freshlock_lock SET expires_at = {past}"))
        .await
        .unwrap();
    let guard = lock
        .acquire(&name, Duration::ZERO, Duration::from_secs(60))
        .await
        .unwrap()
        .expect("expired by the database clock");
    assert_eq!(guard.fence(), Some(8));
    // Expiry and acquired-at come from one database clock reading: exactly the TTL apart.
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT expires_at - acquired_at AS lease, label, pid FROM freshlock_lock \
             WHERE name = 'clock:1'",
        ))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.try_get::<i64>("", "lease").unwrap(), 60_000);
    assert_eq!(row.try_get::<String>("", "label").unwrap(), "clock test");
    assert_eq!(
        row.try_get::<i64>("", "pid").unwrap(),
        i64::from(std::process::id())
    );
    guard.release().await.unwrap();
}
