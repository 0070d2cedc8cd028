//! Shared helpers: a fresh in-memory database per test, a statement recorder, seed data.
#![allow(dead_code)]

pub mod fake_lock;

use std::sync::{Arc, Mutex};

use entity::node;
use freshlock::{LocalLock, LockPolicy, Session};
use migration::{Migrator, MigratorTrait};
use sea_orm::{ConnectOptions, Database, DatabaseConnection, EntityTrait, Set};

/// SQL statements a connection sent (no BEGIN/COMMIT: sea-orm does not report those).
#[derive(Clone, Default)]
pub struct Recorder(Arc<Mutex<Vec<String>>>);

impl Recorder {
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }

    pub fn clear(&self) {
        self.0.lock().unwrap().clear();
    }

    fn push(&self, sql: String) {
        self.0.lock().unwrap().push(sql);
    }
}

/// Counts statements by their first word.
pub fn count(statements: &[String], verb: &str) -> usize {
    statements
        .iter()
        .filter(|s| s.trim_start().to_ascii_uppercase().starts_with(verb))
        .count()
}

/// A fresh in-memory SQLite database with the example schema. The pool never closes its
/// connection, so the database lives as long as the handle.
pub async fn memory_db() -> DatabaseConnection {
    memory_db_recorded().await.0
}

/// Like [`memory_db`], with a recorder of every statement sent after the migrations.
pub async fn memory_db_recorded() -> (DatabaseConnection, Recorder) {
    let mut options = ConnectOptions::new("sqlite::memory:");
    options
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .sqlx_logging(false);
    let mut db = Database::connect(options).await.expect("connect");
    Migrator::up(&db, None).await.expect("migrate");
    let recorder = Recorder::default();
    let sink = recorder.clone();
    db.set_metric_callback(move |info| sink.push(info.statement.to_string()));
    (db, recorder)
}

/// A session with its own lock space (tests run in parallel in one process).
pub fn session(db: &DatabaseConnection, lock: &LocalLock) -> Session {
    Session::builder(db.clone())
        .lock(Arc::new(lock.clone()))
        .build()
        .expect("valid session")
}

/// A policy that fails at once when the lock is busy: proves a lock is free.
pub fn must_lock_now() -> LockPolicy {
    LockPolicy::default()
        .with_tries(1)
        .with_wait_per_try(std::time::Duration::ZERO)
        .with_on_failure(freshlock::OnLockFailure::Fail)
}

/// Inserts nodes 1..=n with empty worker columns.
pub async fn seed_nodes(db: &DatabaseConnection, n: i32) {
    let rows = (1..=n).map(|id| node::ActiveModel {
        id: Set(id),
        title: Set(format!("node {id}")),
        thumbnail: Set(None),
        summary: Set(None),
        score: Set(None),
        analysis: Set(None),
        changed: Set(0),
    });
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
