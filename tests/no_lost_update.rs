//! Nothing is lost even when the lock fails or expires: on a SQLite file, PostgreSQL and MariaDB.

mod common;
#[path = "common/expiring.rs"]
mod expiring;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use common::FakeLock;
use entity::node;
use expiring::ExpiresBeforeUse;
use freshlock::lock::backend::{LeaseLock, LockGuard, LockRole};
use freshlock::lock::{LockName, TableLock};
use freshlock::{Error, LockBackend, LockError, LockPolicy, OnLockFailure, Session, UpdateOutcome};
use sea_orm::{EntityTrait, Set, TransactionTrait};
use servers::{TestDb, databases};
use tokio::sync::Barrier;

fn proceeding(db: &TestDb, lock: Arc<dyn LockBackend>) -> Session {
    Session::builder(&db.handle)
        .lock(lock)
        .policy(
            LockPolicy::default()
                .with_lock_tries(1)
                .with_wait_per_try(Duration::ZERO)
                .with_on_failure(OnLockFailure::Proceed),
        )
        .build()
        .unwrap()
}

/// 8 tasks × 100 increments with no lock at all: every increment is either in the counter or
/// reported as a conflict, and the counter is exactly the reported successes.
async fn increments_without_any_lock(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let start = Arc::new(Barrier::new(8));
    let (successes, conflicts, retried) = (
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
    );
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let session = proceeding(&db, Arc::new(FakeLock::without_lock()));
            let (start, successes, conflicts, retried) = (
                Arc::clone(&start),
                Arc::clone(&successes),
                Arc::clone(&conflicts),
                Arc::clone(&retried),
            );
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                start.wait().await;
                for _ in 0..100 {
                    let result = nodes
                        .locked_update(1, |n| {
                            let score = n.score.as_ref().unwrap_or(0);
                            n.score = Set(Some(score + 1));
                            Ok(())
                        })
                        .await;
                    match result {
                        Ok(report) => {
                            assert!(!report.lock.held);
                            assert!(report.outcome.is_updated());
                            retried.fetch_add(report.attempts - 1, Ordering::SeqCst);
                            successes.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(Error::Conflict { .. }) => {
                            conflicts.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(other) => panic!("unexpected error: {other}"),
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let counter = db.score(1).await.unwrap_or(0) as u32;
    let (successes, conflicts) = (
        successes.load(Ordering::SeqCst),
        conflicts.load(Ordering::SeqCst),
    );
    eprintln!(
        "no lock: counter {counter}, successes {successes}, conflict errors {conflicts}, retried attempts {}",
        retried.load(Ordering::SeqCst)
    );
    assert_eq!(counter + conflicts, 800);
    assert_eq!(counter, successes);
}

/// Four field writers over 100 rows with no lock at all: no field lost.
async fn field_writers_without_any_lock(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(100).await;
    let start = Arc::new(Barrier::new(4));
    let tasks: Vec<_> = (0..4)
        .map(|field| {
            let session = proceeding(&db, Arc::new(FakeLock::without_lock()));
            let start = Arc::clone(&start);
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                start.wait().await;
                for id in 1..=100 {
                    nodes.load(id).await.unwrap();
                    nodes
                        .locked_update(id, |n| {
                            let value = Some(format!("{field}:{id}"));
                            match field {
                                0 => n.thumbnail = Set(value),
                                1 => n.summary = Set(value),
                                2 => n.score = Set(Some(id)),
                                _ => n.analysis = Set(value),
                            }
                            Ok(())
                        })
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let rows = db.all_nodes().await;
    let lost: usize = rows
        .iter()
        .map(|r| {
            usize::from(r.thumbnail.is_none())
                + usize::from(r.summary.is_none())
                + usize::from(r.score.is_none())
                + usize::from(r.analysis.is_none())
        })
        .sum();
    assert_eq!(lost, 0);
}

/// A table lease that always expires before the write: each write is fenced (reported) or
/// committed, never silently lost.
async fn lease_shorter_than_the_section(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let lock: Arc<dyn LockBackend> = Arc::new(ExpiresBeforeUse(TableLock::new(&db.handle)));
    let session = Session::builder(&db.handle)
        .lock(lock)
        .policy(
            LockPolicy::default()
                .with_ttl(Duration::from_millis(1))
                .with_on_failure(OnLockFailure::Fail),
        )
        .build()
        .unwrap();
    let nodes = session.repository::<node::Entity>();
    let (mut committed, mut fenced) = (0, 0);
    for _ in 0..20 {
        let report = nodes
            .locked_update(1, |n| {
                let score = n.score.as_ref().unwrap_or(0);
                n.score = Set(Some(score + 1));
                Ok(())
            })
            .await
            .unwrap();
        match report.outcome {
            UpdateOutcome::Updated(_) => committed += 1,
            UpdateOutcome::LeaseLost => fenced += 1,
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    eprintln!("short lease: {committed} committed, {fenced} fenced");
    assert_eq!(fenced, 20, "an expired lease never writes");
    let score = db.score(1).await;
    assert_eq!(score.unwrap_or(0), committed);
}

/// The row deleted after the lock was taken and before the reload: not found, nothing written.
async fn row_deleted_under_the_lock(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let lock: Arc<dyn LockBackend> = Arc::new(DeletesAfterAcquire(db.db.clone()));
    let session = proceeding(&db, lock);
    let applied = AtomicU32::new(0);
    let report = session
        .repository::<node::Entity>()
        .locked_update(1, |n| {
            applied.fetch_add(1, Ordering::SeqCst);
            n.score = Set(Some(1));
            Ok(())
        })
        .await
        .unwrap();
    assert!(matches!(report.outcome, UpdateOutcome::NotFound));
    assert_eq!(applied.load(Ordering::SeqCst), 0);
    assert!(db.all_nodes().await.is_empty());
}

#[derive(Debug)]
struct DeletesAfterAcquire(sea_orm::DatabaseConnection);

impl LockBackend for DeletesAfterAcquire {
    fn kind(&self) -> freshlock::LockKind {
        freshlock::LockKind::Other("deleting")
    }

    fn role(&self) -> LockRole<'_> {
        LockRole::Lease(self)
    }
}

#[async_trait::async_trait]
impl LeaseLock for DeletesAfterAcquire {
    async fn acquire(
        &self,
        name: &LockName,
        wait: Duration,
        ttl: Duration,
    ) -> Result<Option<Box<dyn LockGuard>>, LockError> {
        let guard = freshlock::lock::LocalLock::new()
            .acquire(name, wait, ttl)
            .await?;
        // In a transaction: behind a transaction pooler no statement may run outside one.
        let txn = self.0.begin().await.unwrap();
        node::Entity::delete_by_id(1).exec(&txn).await.unwrap();
        txn.commit().await.unwrap();
        Ok(guard)
    }
}

macro_rules! on_each_database {
    ($($scenario:ident),*) => {
        mod sqlite { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $scenario() { super::$scenario(databases::sqlite(stringify!($scenario)).await).await } )* }
        mod postgres { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $scenario() { super::$scenario(databases::postgres(stringify!($scenario)).await).await } )* }
        mod mariadb { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $scenario() { super::$scenario(databases::mysql(stringify!($scenario)).await).await } )* }
    };
}

on_each_database!(
    increments_without_any_lock,
    field_writers_without_any_lock,
    lease_shorter_than_the_section,
    row_deleted_under_the_lock
);
