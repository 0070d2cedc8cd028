//! The lock inspector (`freshlock::inspect`): held and expired leases listed with their holders,
//! only expired ones cleared; in memory, on a SQLite file, PostgreSQL and MariaDB.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::time::Duration;

use common::memory_db;
use freshlock::inspect;
use freshlock::lock::backend::LeaseLock;
use freshlock::lock::{LockName, TableLock};
use servers::databases;

fn key(s: &str) -> LockName {
    LockName::new(s).unwrap()
}

#[tokio::test]
async fn the_inspector_lists_and_clears_only_expired_leases() {
    inspector_lists_and_clears_only_expired_leases(memory_db().await).await;
}

async fn inspector_on(db: Option<servers::TestDb>, _: ()) {
    if let Some(db) = db {
        inspector_lists_and_clears_only_expired_leases(db.db).await;
    }
}

servers::server_tests! {
    inspector_sqlite_file: inspector_on, (), sqlite;
    inspector_postgres: inspector_on, (), postgres;
    inspector_mysql: inspector_on, (), mysql;
}

/// A live and an expired lease (the holder died): both listed, only the expired one listed by
/// `expired_only` and cleared, the live one still its holder's.
async fn inspector_lists_and_clears_only_expired_leases(db: sea_orm::DatabaseConnection) {
    let live_lock = TableLock::new(db.clone()).with_label("live worker");
    let live = live_lock
        .acquire(&key("ham:1"), Duration::ZERO, Duration::from_secs(3600))
        .await
        .unwrap()
        .unwrap();
    let dead = TableLock::new(db.clone()).with_label("dead worker");
    let stale = dead
        .acquire(&key("ham:2"), Duration::ZERO, Duration::from_millis(1))
        .await
        .unwrap()
        .unwrap();
    std::mem::forget(stale); // the holder died: no release, not even the background one
    // Wait (database clock) until the short lease has run out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while inspect::held_locks(&db, freshlock::inspect::Held::Expired)
        .await
        .unwrap()
        .is_empty()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the 1 ms lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let all = inspect::held_locks(&db, freshlock::inspect::Held::All)
        .await
        .unwrap();
    assert_eq!(all.len(), 2);
    let live_row = all.iter().find(|l| l.name == "ham:1").unwrap();
    assert_eq!(live_row.label.as_deref(), Some("live worker"));
    assert_eq!(live_row.pid, Some(i64::from(std::process::id())));
    assert!(live_row.host.is_some() && !live_row.expired);

    let expired = inspect::held_locks(&db, freshlock::inspect::Held::Expired)
        .await
        .unwrap();
    assert_eq!(
        expired.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
        ["ham:2"]
    );
    assert_eq!(inspect::release_stale(&db).await.unwrap(), 1);
    let left = inspect::held_locks(&db, freshlock::inspect::Held::All)
        .await
        .unwrap();
    assert_eq!(
        left.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
        ["ham:1"],
        "a live lease is never cleared"
    );
    assert!(
        live.extend(Duration::from_secs(60)).await.unwrap(),
        "still the live holder's"
    );
    live.release().await.unwrap();
}
