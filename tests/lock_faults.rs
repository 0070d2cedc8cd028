//! Lock faults: failed release after commit, lost lease, missing table, unreachable server,
//! lease expiry by the database clock.

mod common;

use std::{sync::Arc, time::Duration};

use common::{FakeLock, memory_db, node_in_db, seed_nodes};
use entity::node;
use freshlock::testing::TestDatabase;
use freshlock::{
    Error, LockBackend, LockError, LockName, LockPolicy, OnLockFailure, Session, TableLock,
    UpdateOutcome,
};
use sea_orm::{ConnectionTrait, Set, Statement};

fn session_with(
    db: &sea_orm::DatabaseConnection,
    lock: Arc<dyn LockBackend>,
    on_failure: OnLockFailure,
) -> Session {
    Session::builder(db.clone())
        .lock(lock)
        .policy(
            LockPolicy::default()
                .with_tries(2)
                .with_wait_per_try(Duration::from_millis(10))
                .with_on_failure(on_failure),
        )
        .build()
        .unwrap()
}

fn set_score(
    score: i32,
) -> impl FnMut(&mut node::ActiveModel) -> Result<(), freshlock::ApplyError> {
    move |n| {
        n.score = Set(Some(score));
        Ok(())
    }
}

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
    assert!(error.contains("fake lock backend failed"), "{error}");
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

#[tokio::test]
async fn lock_not_acquired_fails_or_proceeds_as_the_policy_says() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let fake = FakeLock::new();
    fake.never_acquire(true);

    let strict = session_with(&db, Arc::new(fake.clone()), OnLockFailure::Fail);
    let refused = strict
        .repository::<node::Entity>()
        .locked_update(1, set_score(1))
        .await;
    match refused {
        Err(Error::LockNotAcquired { tries, lock, .. }) => {
            assert_eq!(tries, 2);
            assert_eq!(lock, "node:1");
        }
        other => panic!("expected LockNotAcquired, got {other:?}"),
    }

    let lenient = session_with(&db, Arc::new(fake.clone()), OnLockFailure::Proceed);
    let report = lenient
        .repository::<node::Entity>()
        .locked_update(1, set_score(2))
        .await
        .unwrap();
    assert!(!report.lock.held, "the report says the lock was not held");
    assert!(report.outcome.is_updated());

    fake.fail_after(0);
    let failing = strict
        .repository::<node::Entity>()
        .locked_update(1, set_score(3))
        .await;
    assert!(matches!(
        failing,
        Err(Error::Lock {
            source: LockError::Backend {
                backend: "fake",
                ..
            },
            ..
        })
    ));
    assert_eq!(node_in_db(&db, 1).await.score, Some(2));
}

#[tokio::test]
async fn a_missing_lock_table_names_the_migration() {
    // A database with the data table but without freshlock's tables.
    let db = TestDatabase::empty().await.unwrap();
    let db = db.connection().clone();
    let schema = sea_orm::Schema::new(db.get_database_backend());
    db.execute(&schema.create_table_from_entity(node::Entity))
        .await
        .unwrap();
    seed_nodes(&db, 1).await;
    let session = session_with(
        &db,
        Arc::new(TableLock::new(db.clone())),
        OnLockFailure::Fail,
    );
    let error = session
        .repository::<node::Entity>()
        .locked_update(1, set_score(1))
        .await
        .expect_err("no lock table");
    let Error::Lock {
        source: LockError::MissingTable { table, migration },
        ..
    } = &error
    else {
        panic!("expected MissingTable, got {error:?}");
    };
    assert_eq!(*table, "freshlock_lock");
    assert_eq!(*migration, freshlock::schema::MIGRATION_NAME);
    use std::error::Error as _;
    assert!(
        format!("{}", error.source().unwrap()).contains("m20261130_000100_create_freshlock_tables")
    );
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

#[cfg(feature = "redis")]
#[tokio::test]
async fn an_unreachable_redis_is_a_typed_error_not_a_hang() {
    let db = memory_db().await;
    // A hang guard, not a speed target: the backend's own call timeout is 2 s.
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        freshlock::RedisLock::connect("redis://127.0.0.1:1", db),
    )
    .await
    .expect("an unreachable Redis is reported, never waited on forever");
    assert!(matches!(
        result,
        Err(LockError::Backend {
            backend: "redis",
            ..
        })
    ));
}

#[test]
fn bad_names_are_typed_errors() {
    assert!(matches!(LockName::new(""), Err(LockError::EmptyName)));
    assert!(matches!(
        "".parse::<freshlock::LockKind>(),
        Err(LockError::UnknownKind { .. })
    ));
}
