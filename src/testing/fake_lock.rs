//! A lease-lock test double with failure switches.

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use sea_orm::{ConnectionTrait, DatabaseTransaction};

use crate::{
    error::LockError,
    lock::{
        Fencing, LocalLock, LockBackend, LockGuard, LockKind, LockName, LockRole,
        backend::Acquired, traits::LeaseLock,
    },
};

const KIND: &str = "fake";

/// A [`LockBackend`] for fault tests: it grants every lease (with increasing fences) until a
/// switch says otherwise. Clones share their switches and counters, so a test keeps one clone
/// and hands the other to a session:
///
/// ```
/// use std::sync::Arc;
/// use freshlock::testing::{FakeLock, TestDatabase};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let db = TestDatabase::new().await?;
/// let fake = FakeLock::new();
/// let session = db.session_builder().lock(Arc::new(fake.clone())).build()?;
/// fake.never_acquire(true); // every try answers "busy"
/// # let _ = session;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
///
/// The switches are read when a call starts; flipping one affects the calls that follow.
#[derive(Clone, Debug, Default)]
pub struct FakeLock {
    state: Arc<State>,
    /// Its in-process queue (see `LockBackend::queue`), shared by its clones.
    queue: LocalLock,
    /// Says it is in-process (see `LockBackend::in_process`): no in-process queue either.
    in_process: bool,
}

#[derive(Debug, Default)]
struct State {
    never_acquires: AtomicBool,
    fail_after: Mutex<Option<u64>>,
    delay: Mutex<Duration>,
    release_fails: AtomicBool,
    lease_lost: AtomicBool,
    tries: AtomicU64,
    grants: AtomicU64,
    releases: AtomicU64,
    interfere: Mutex<Option<(String, u32)>>,
}

impl FakeLock {
    /// A double that grants every lease at once.
    pub fn new() -> Self {
        Self::default()
    }

    /// A double that fails every acquisition and says it excludes in-process by itself
    /// ([`LockBackend::in_process`]), so sessions skip their in-process queue as well: writers then run with no lock at all,
    /// which leaves freshlock's optimistic guard as the only protection (what a write sees when
    /// every lock server is down and the policy says to proceed).
    pub fn without_lock() -> Self {
        let fake = Self {
            in_process: true,
            ..Self::default()
        };
        fake.fail_after(0);
        fake
    }

    /// `true`: every try answers "busy" (after the [`slow`](Self::slow) delay), as a lock that
    /// somebody else holds.
    pub fn never_acquire(&self, on: bool) -> &Self {
        self.state.never_acquires.store(on, Ordering::SeqCst);
        self
    }

    /// After `grants` more successful acquisitions, every try fails with a backend error (a
    /// lock server that went away); `fail_after(0)` fails from now on.
    pub fn fail_after(&self, grants: u64) -> &Self {
        let base = self.state.grants.load(Ordering::SeqCst);
        *lock(&self.state.fail_after) = Some(base + grants);
        self
    }

    /// Acquisitions succeed again (undoes [`fail_after`](Self::fail_after)).
    pub fn recover(&self) -> &Self {
        *lock(&self.state.fail_after) = None;
        self
    }

    /// Every try waits `delay` before answering (a slow lock server). Uses tokio's clock, so
    /// `tokio::time::pause` makes it instant in tests.
    pub fn slow(&self, delay: Duration) -> &Self {
        *lock(&self.state.delay) = delay;
        self
    }

    /// `true`: releasing a lease fails (the write it guarded has committed already).
    pub fn fail_release(&self, on: bool) -> &Self {
        self.state.release_fails.store(on, Ordering::SeqCst);
        self
    }

    /// `true`: leases report themselves lost when checked before the write, as an expired lease
    /// taken over by another worker; the write is then refused.
    pub fn lose_lease(&self, on: bool) -> &Self {
        self.state.lease_lost.store(on, Ordering::SeqCst);
        self
    }

    /// Runs `sql` in the write's transaction right before the next `times` writes (from the
    /// lease check): a concurrent change of the row between its reload and its write, as a
    /// writer that holds no lock would make it. `interfere("", 0)` cancels what is pending.
    pub fn interfere(&self, sql: &str, times: u32) -> &Self {
        *lock(&self.state.interfere) = Some((sql.to_owned(), times));
        self
    }

    /// Acquisitions tried so far (granted, busy or failed).
    pub fn tries(&self) -> u64 {
        self.state.tries.load(Ordering::SeqCst)
    }

    /// Leases granted so far.
    pub fn grants(&self) -> u64 {
        self.state.grants.load(Ordering::SeqCst)
    }

    /// Leases released so far (successfully or not): `grants() - releases()` are held now.
    pub fn releases(&self) -> u64 {
        self.state.releases.load(Ordering::SeqCst)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn failure(what: &str) -> LockError {
    LockError::Backend {
        backend: KIND,
        source: what.into(),
    }
}

impl LockBackend for FakeLock {
    fn kind(&self) -> LockKind {
        LockKind::Other(KIND)
    }

    fn in_process(&self) -> bool {
        self.in_process
    }

    fn queue(&self) -> Option<&dyn LockBackend> {
        Some(&self.queue)
    }

    fn role(&self) -> LockRole<'_> {
        LockRole::Lease(self)
    }
}

#[async_trait]
impl LeaseLock for FakeLock {
    async fn acquire(&self, _name: &LockName, _wait: Duration, _ttl: Duration) -> Acquired {
        self.state.tries.fetch_add(1, Ordering::SeqCst);
        let delay = *lock(&self.state.delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let limit = *lock(&self.state.fail_after);
        if limit.is_some_and(|limit| self.state.grants.load(Ordering::SeqCst) >= limit) {
            return Err(failure("switched off"));
        }
        if self.state.never_acquires.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let fence = self.state.grants.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Some(Box::new(FakeGuard {
            state: Arc::clone(&self.state),
            fence,
        })))
    }
}

#[derive(Debug)]
struct FakeGuard {
    state: Arc<State>,
    fence: u64,
}

#[async_trait]
impl LockGuard for FakeGuard {
    fn fencing(&self) -> Option<&dyn Fencing> {
        Some(self)
    }

    async fn release(self: Box<Self>) -> Result<(), LockError> {
        self.state.releases.fetch_add(1, Ordering::SeqCst);
        if self.state.release_fails.load(Ordering::SeqCst) {
            return Err(failure("connection reset"));
        }
        Ok(())
    }
}

#[async_trait]
impl Fencing for FakeGuard {
    fn fence(&self) -> u64 {
        self.fence
    }

    async fn verify(&self, txn: &DatabaseTransaction) -> Result<bool, LockError> {
        let sql = match lock(&self.state.interfere).as_mut() {
            Some((sql, left)) if *left > 0 => {
                *left -= 1;
                Some(sql.clone())
            }
            _ => None,
        };
        if let Some(sql) = sql {
            txn.execute_unprepared(&sql)
                .await
                .map_err(|e| failure(&format!("interference failed: {e}")))?;
        }
        Ok(!self.state.lease_lost.load(Ordering::SeqCst))
    }
}
