//! Shared helpers: a fresh in-memory database per test, a statement recorder, seed data.
#![allow(dead_code, unused_imports)]

use std::sync::Arc;

mod eventually;
pub use eventually::eventually;

use entity::node;
use freshlock::lock::LocalLock;
pub use freshlock::testing::{FakeLock, Recorder, TestDatabase};
use freshlock::{LockPolicy, Session};
use migration::Migrator;
use sea_orm::{DatabaseConnection, EntityTrait, Set};

/// A fresh anchored in-memory SQLite database with the example schema (our `Migrator`, which
/// includes freshlock's migrations), from the `testing` helpers we ship.
pub async fn test_db() -> TestDatabase {
    TestDatabase::with_migrator::<Migrator>()
        .await
        .expect("test database")
}

/// The connection of a fresh [`test_db`]; the database lives as long as any clone of it.
pub async fn memory_db() -> DatabaseConnection {
    test_db().await.connection().clone()
}

/// Like [`memory_db`], with a recorder of every statement sent after the migrations.
pub async fn memory_db_recorded() -> (DatabaseConnection, Recorder) {
    let db = test_db().await;
    (db.connection().clone(), db.recorder().clone())
}

/// A session with its own lock space (tests run in parallel in one process).
pub fn session(db: &DatabaseConnection, lock: &LocalLock) -> Session {
    Session::builder(db.clone())
        .lock(Arc::new(lock.clone()))
        .build()
        .expect("valid session")
}

/// How many of `statements` begin with `verb` (case-insensitive, leading blanks ignored).
pub fn count(statements: &[String], verb: &str) -> usize {
    statements
        .iter()
        .filter(|s| {
            s.trim_start()
                .get(..verb.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(verb))
        })
        .count()
}

/// A policy that fails at once when the lock is busy: proves a lock is free.
pub fn must_lock_now() -> LockPolicy {
    LockPolicy::default()
        .with_lock_tries(1)
        .with_wait_per_try(std::time::Duration::ZERO)
        .with_on_failure(freshlock::OnLockFailure::Fail)
}

/// Inserts nodes 1..=n with empty worker columns.
pub async fn seed_nodes(db: &DatabaseConnection, n: i32) {
    let rows = (1..=n).map(node::ActiveModel::fresh);
    for chunk in rows.collect::<Vec<_>>().chunks(200) {
        node::Entity::insert_many(chunk.to_vec())
            .exec(db)
            .await
            .expect("seed nodes");
    }
}

/// The row as the database has it now.
pub async fn node_in_db(db: &DatabaseConnection, id: i32) -> node::Model {
    node::Entity::find_by_id(id)
        .one(db)
        .await
        .expect("query")
        .expect("row exists")
}

/// A session whose policy tries a lock twice, 10 ms each, then does what `on_failure` says.
pub fn session_trying_twice(
    db: &sea_orm::DatabaseConnection,
    lock: Arc<dyn freshlock::LockBackend>,
    on_failure: freshlock::OnLockFailure,
) -> Session {
    Session::builder(db.clone())
        .lock(lock)
        .policy(
            freshlock::LockPolicy::default()
                .with_lock_tries(2)
                .with_wait_per_try(std::time::Duration::from_millis(10))
                .with_on_failure(on_failure),
        )
        .build()
        .unwrap()
}

/// An `apply` that sets node's score to `score`.
pub fn set_score(
    score: i32,
) -> impl FnMut(&mut node::ActiveModel) -> Result<(), freshlock::ApplyError> {
    move |n| {
        n.score = sea_orm::Set(Some(score));
        Ok(())
    }
}
