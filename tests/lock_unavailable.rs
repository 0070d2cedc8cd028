//! A lock that cannot be had: the policy decides (fail or proceed), a missing lock table names
//! its migration, an unreachable Redis is a typed error, not a hang.

mod common;

use std::sync::Arc;

use common::{
    FakeLock, memory_db, node_in_db, seed_nodes, session_trying_twice as session_with, set_score,
};
use entity::node;
use freshlock::lock::{LockName, TableLock};
use freshlock::testing::TestDatabase;
use freshlock::{Error, LockError, OnLockFailure};
use sea_orm::ConnectionTrait;

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

#[cfg(feature = "redis")]
#[tokio::test]
async fn an_unreachable_redis_is_a_typed_error_not_a_hang() {
    let db = memory_db().await;
    // A hang guard, not a speed target: the backend's own call timeout is 2 s.
    let result = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        freshlock::lock::RedisLock::connect("redis://127.0.0.1:1", db),
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
