//! The Django report's workload: 2,000 Spam tasks over 20 Hams (half on one Ham), 8 workers,
//! claim → heavy work with no transaction open → finish, serialized per Ham through freshlock —
//! while another connection locks the hot Ham without waiting and updates it. freshlock never
//! refuses it; the report's first approach, which locks the Ham row itself, does.

#[path = "common/servers.rs"]
mod servers;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use freshlock::claim::Claims;
use freshlock::lock::backend::{LeaseLock, LockGuard, LockRole};
use freshlock::lock::{LockName, TableLock};
use freshlock::{LockBackend, LockError, LockPolicy, OnLockFailure, Session};
use sea_orm::ConnectionTrait;
use servers::{TestDb, databases};
use tokio::time::Instant;
use workload::django::{self, Probes, Strategy};

const SPAMS: i32 = 2000;
const WORKERS: usize = 8;

/// Fails loudly if two holders of the same lock name are ever inside at once.
#[derive(Debug)]
struct Occupancy {
    inner: TableLock,
    inside: Arc<Mutex<HashMap<String, bool>>>,
}

impl LockBackend for Occupancy {
    fn queue(&self) -> Option<&dyn LockBackend> {
        self.inner.queue()
    }

    fn kind(&self) -> freshlock::LockKind {
        freshlock::LockKind::Table
    }

    fn role(&self) -> LockRole<'_> {
        LockRole::Lease(self)
    }
}

#[async_trait]
impl LeaseLock for Occupancy {
    async fn acquire(
        &self,
        name: &LockName,
        wait: Duration,
        ttl: Duration,
    ) -> Result<Option<Box<dyn LockGuard>>, LockError> {
        let guard = self.inner.acquire(name, wait, ttl).await?;
        Ok(guard.map(|inner| {
            let was = self.inside.lock().unwrap().insert(name.to_string(), true);
            assert_ne!(was, Some(true), "two holders of {name} at once");
            Box::new(Inside {
                inner: Some(inner),
                name: name.to_string(),
                inside: Arc::clone(&self.inside),
            }) as Box<dyn LockGuard>
        }))
    }
}

#[derive(Debug)]
struct Inside {
    inner: Option<Box<dyn LockGuard>>,
    name: String,
    inside: Arc<Mutex<HashMap<String, bool>>>,
}

#[async_trait]
impl LockGuard for Inside {
    // Its own fencing, not the inner guard's: only `verify` is passed on, so the lease is never
    // freed by the write's commit (`verify_and_release_in` keeps its default) and every release
    // goes through `release` below.
    fn fencing(&self) -> Option<&dyn freshlock::lock::backend::Fencing> {
        Some(self)
    }

    async fn release(mut self: Box<Self>) -> Result<(), LockError> {
        // Leave before the lease is released: the next holder may enter right after.
        self.inside.lock().unwrap().insert(self.name.clone(), false);
        self.inner.take().unwrap().release().await
    }
}

#[async_trait]
impl freshlock::lock::backend::Fencing for Inside {
    fn fence(&self) -> u64 {
        let inner = self.inner.as_ref().and_then(|g| g.fencing());
        inner.map_or(0, |f| f.fence())
    }

    async fn verify(&self, txn: &sea_orm::DatabaseTransaction) -> Result<bool, LockError> {
        match self.inner.as_ref() {
            Some(inner) => inner.verify(txn).await,
            None => Ok(false),
        }
    }
}

/// freshlock: claims with a lease, both short sections serialized by the Ham's key (not its row).
/// Returns how many deliveries were processed, and what the prober saw.
async fn with_freshlock(db: &TestDb) -> (u32, Probes) {
    let inside = Arc::new(Mutex::new(HashMap::new()));
    let backend: Arc<dyn LockBackend> = Arc::new(Occupancy {
        inner: TableLock::new(db.db.clone()),
        inside,
    });
    let stop = Arc::new(AtomicBool::new(false));
    let prober = tokio::spawn(django::probe_hot_ham(db.db.clone(), Arc::clone(&stop)));
    let queue = Arc::new(Mutex::new(django::deliveries(SPAMS)));
    let processed = Arc::new(AtomicU32::new(0));
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let worker = django::Worker {
                db: db.db.clone(),
                session: Session::builder(db.db.clone())
                    .lock(Arc::clone(&backend))
                    .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
                    .build()
                    .unwrap(),
                claims: Claims::new(db.db.clone()).with_label(format!("worker {w}")),
                work_ms: django::TEST_WORK_MS,
            };
            let (queue, processed) = (Arc::clone(&queue), Arc::clone(&processed));
            tokio::spawn(async move {
                loop {
                    let Some(id) = queue.lock().unwrap().pop() else {
                        break;
                    };
                    let did = django::task(Strategy::LockRow, &worker, id).await.unwrap();
                    if did.is_some() {
                        processed.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    (
        processed.load(Ordering::SeqCst),
        prober.await.unwrap().unwrap(),
    )
}

/// The report's first approach: lock the Ham row itself, with the work inside the transaction.
async fn with_parent_row_lock(db: &TestDb) -> Probes {
    let stop = Arc::new(AtomicBool::new(false));
    let prober = tokio::spawn(django::probe_hot_ham(db.db.clone(), Arc::clone(&stop)));
    let queue: Arc<Mutex<Vec<i32>>> = Arc::new(Mutex::new((1..=SPAMS / 4).collect()));
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let worker = django::Worker {
                db: db.db.clone(),
                session: Session::new(db.db.clone()),
                claims: Claims::new(db.db.clone()),
                work_ms: django::TEST_WORK_MS,
            };
            let queue = Arc::clone(&queue);
            tokio::spawn(async move {
                loop {
                    let Some(id) = queue.lock().unwrap().pop() else {
                        break;
                    };
                    assert!(
                        django::task(Strategy::ParentRowLock, &worker, id)
                            .await
                            .unwrap()
                            .is_some()
                    );
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    prober.await.unwrap().unwrap()
}

async fn workload(db: Option<TestDb>, label: &str) {
    let Some(db) = db else { return };
    django::seed(&db.db, SPAMS).await.unwrap();
    let started = Instant::now();
    let (processed, mut ours) = with_freshlock(&db).await;
    let wall = started.elapsed();
    assert_eq!(processed, SPAMS as u32, "every Spam processed exactly once");
    assert_eq!(django::done(&db.db).await.unwrap(), SPAMS as u64);

    db.db
        .execute_unprepared("UPDATE spam SET state = 'new'")
        .await
        .unwrap();
    let mut theirs = with_parent_row_lock(&db).await;
    let (our_p50, our_p99) = (ours.percentile(50), ours.percentile(99));
    eprintln!(
        "{label}: 2,000 Spams in {wall:?}; hot Ham locked + updated while running — freshlock: p50 {our_p50:?}, p99 {our_p99:?}, {} refused of {}; parent-row lock: p50 {:?}, p99 {:?}, {} refused of {}",
        ours.refused,
        ours.refused as usize + ours.latencies.len(),
        theirs.percentile(50),
        theirs.percentile(99),
        theirs.refused,
        theirs.refused as usize + theirs.latencies.len(),
    );
    assert_eq!(ours.refused, 0, "freshlock never locks the Ham row");
    assert!(
        theirs.refused > 0,
        "the parent-row approach does (the prober can tell)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn django_workload_postgres() {
    workload(databases::postgres("django_pg").await, "PostgreSQL").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn django_workload_mariadb() {
    workload(databases::mysql("django_my").await, "MariaDB").await;
}
