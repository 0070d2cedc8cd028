//! A lease-lock test double with failure switches.
#![allow(dead_code)]

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use freshlock::{LockBackend, LockError, LockGuard, LockName};
use sea_orm::DatabaseTransaction;

/// Switches, shared with the guards it hands out.
#[derive(Debug, Default)]
pub struct Switches {
    pub never_acquires: AtomicBool,
    pub acquire_fails: AtomicBool,
    pub release_fails: AtomicBool,
    pub lease_lost: AtomicBool,
    pub grants: AtomicU64,
    /// SQL that `verify` runs in the write's transaction, this many more times: a concurrent
    /// change of the row between its reload and its write, as the optimistic guard sees it.
    pub interfere: std::sync::Mutex<Option<(String, u32)>>,
}

#[derive(Clone, Debug, Default)]
pub struct FakeLock(pub Arc<Switches>, pub Option<&'static str>);

impl FakeLock {
    /// A double that never gets the lock and says it is the in-process backend, so sessions
    /// skip their in-process queue too: writers then have no lock at all.
    pub fn no_lock_at_all() -> Self {
        let fake = FakeLock(Arc::default(), Some("local"));
        fake.0.acquire_fails.store(true, Ordering::SeqCst);
        fake
    }

    /// Makes the next `times` writes see `sql` run just before them.
    pub fn interfere(&self, sql: &str, times: u32) {
        *self.0.interfere.lock().unwrap() = Some((sql.to_owned(), times));
    }
}

#[async_trait]
impl LockBackend for FakeLock {
    fn kind(&self) -> &'static str {
        self.1.unwrap_or("fake")
    }

    async fn acquire(
        &self,
        _name: &LockName,
        _wait: Duration,
        _ttl: Duration,
    ) -> Result<Option<Box<dyn LockGuard>>, LockError> {
        if self.0.acquire_fails.load(Ordering::SeqCst) {
            return Err(LockError::Backend {
                backend: "fake",
                source: "switched off".into(),
            });
        }
        if self.0.never_acquires.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let fence = self.0.grants.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Some(Box::new(FakeGuard {
            switches: Arc::clone(&self.0),
            fence,
        })))
    }
}

#[derive(Debug)]
struct FakeGuard {
    switches: Arc<Switches>,
    fence: u64,
}

#[async_trait]
impl LockGuard for FakeGuard {
    fn fence(&self) -> Option<u64> {
        Some(self.fence)
    }

    async fn verify(&self, txn: &DatabaseTransaction) -> Result<bool, LockError> {
        use sea_orm::ConnectionTrait;
        let sql = {
            let mut interfere = self.switches.interfere.lock().unwrap();
            match interfere.as_mut() {
                Some((sql, left)) if *left > 0 => {
                    *left -= 1;
                    Some(sql.clone())
                }
                _ => None,
            }
        };
        if let Some(sql) = sql {
            txn.execute_unprepared(&sql).await.unwrap();
        }
        Ok(!self.switches.lease_lost.load(Ordering::SeqCst))
    }

    async fn release(self: Box<Self>) -> Result<(), LockError> {
        if self.switches.release_fails.load(Ordering::SeqCst) {
            return Err(LockError::Backend {
                backend: "fake",
                source: "connection reset".into(),
            });
        }
        Ok(())
    }
}
