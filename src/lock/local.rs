//! The in-process lock: one fair async mutex per name, created on demand.

use std::{
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use dashmap::DashMap;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::{
    kind::LockKind,
    name::LockName,
    traits::{Acquired, LeaseLock, LockBackend, LockGuard, LockRole},
};
use crate::error::LockError;

type Entries = DashMap<LockName, Arc<Mutex<()>>>;

/// Excludes the tasks of one process from each other, per lock name.
///
/// Each name gets a `tokio::sync::Mutex`: waiters queue in FIFO order and the next one is woken
/// directly by the release — nobody polls. An entry exists only while somebody holds or waits for
/// its name, so memory does not grow with the number of distinct names ever locked.
///
/// It protects nothing across processes; the TTL is ignored because a holder cannot outlive the
/// process that holds the lock. Cloning is cheap and clones share their locks;
/// [`LocalLock::shared`] is the process-wide instance sessions use by default.
#[derive(Clone, Debug)]
pub struct LocalLock {
    entries: Arc<Entries>,
    /// Which lock space this is: unique in the process, shared by clones (never an address, so
    /// a later lock space cannot be mistaken for a dropped one).
    id: u64,
}

impl Default for LocalLock {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self {
            entries: Arc::default(),
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }
}

impl LocalLock {
    /// A new lock space, independent of every other.
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide lock space (the default of every session).
    pub fn shared() -> Self {
        static SHARED: OnceLock<LocalLock> = OnceLock::new();
        SHARED.get_or_init(LocalLock::new).clone()
    }

    /// Which lock space this is (see the field): writes of the process that exclude each other
    /// through the same lock space may share a commit.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// How many names are held or waited for right now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// How many tasks hold or wait for `name` right now (0: free, 1: held, more: queued).
    pub fn queue_len(&self, name: &LockName) -> usize {
        self.entries
            .get(name)
            .map_or(0, |mutex| Arc::strong_count(mutex.value()) - 1)
    }

    /// Whether no name is held or waited for.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops `name`'s entry when nobody but the map refers to it. The check runs under the
    /// shard's write lock, and new references are only made under that lock, so an entry somebody
    /// is about to wait on is never removed.
    fn forget_if_unused(&self, name: &LockName) {
        self.entries
            .remove_if(name, |_, mutex| Arc::strong_count(mutex) == 1);
    }
}

impl LockBackend for LocalLock {
    fn kind(&self) -> LockKind {
        LockKind::Local
    }

    fn in_process(&self) -> bool {
        true
    }

    fn lock_space(&self) -> Option<u64> {
        Some(self.id())
    }

    fn role(&self) -> LockRole<'_> {
        LockRole::Lease(self)
    }
}

#[async_trait]
impl LeaseLock for LocalLock {
    async fn acquire(&self, name: &LockName, wait: Duration, _ttl: Duration) -> Acquired {
        let mutex = self.entries.entry(name.clone()).or_default().clone();
        // If this future is dropped while waiting, `Waiting` still drops the entry's reference
        // and forgets the entry when it was the last one.
        let waiting = Waiting {
            lock: self,
            name,
            mutex: Some(mutex),
        };
        let guard = waiting.lock(wait).await;
        Ok(guard.map(|guard| {
            Box::new(LocalGuard {
                lock: self.clone(),
                name: name.clone(),
                guard: Some(guard),
            }) as Box<dyn LockGuard>
        }))
    }
}

/// A reference to a name's mutex held while waiting for it.
struct Waiting<'a> {
    lock: &'a LocalLock,
    name: &'a LockName,
    mutex: Option<Arc<Mutex<()>>>,
}

impl Waiting<'_> {
    async fn lock(mut self, wait: Duration) -> Option<OwnedMutexGuard<()>> {
        let mutex = self.mutex.take()?;
        if wait.is_zero() {
            return mutex.try_lock_owned().ok();
        }
        tokio::time::timeout(wait, mutex.lock_owned()).await.ok()
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        // The mutex reference (ours, or the one moved into the guard/timed-out future) is gone
        // by now unless we still hold it: release it first, then forget the entry if unused.
        drop(self.mutex.take());
        self.lock.forget_if_unused(self.name);
    }
}

/// A held in-process lock. Dropping it releases the lock at once, like [`LockGuard::release`].
struct LocalGuard {
    lock: LocalLock,
    name: LockName,
    guard: Option<OwnedMutexGuard<()>>,
}

impl std::fmt::Debug for LocalGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalGuard")
            .field("name", &self.name)
            .finish()
    }
}

#[async_trait]
impl LockGuard for LocalGuard {
    async fn release(self: Box<Self>) -> Result<(), LockError> {
        drop(self);
        Ok(())
    }
}

impl Drop for LocalGuard {
    fn drop(&mut self) {
        // Unlock first (this wakes the next waiter, who holds its own reference), then forget the
        // entry if nobody holds or waits.
        drop(self.guard.take());
        self.lock.forget_if_unused(&self.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> LockName {
        LockName::new(s).expect("valid name")
    }

    const TTL: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn second_try_lock_fails_while_held_and_succeeds_after_release() {
        let lock = LocalLock::new();
        let first = lock.acquire(&name("a"), Duration::ZERO, TTL).await;
        let first = first.ok().flatten().expect("free lock is taken");
        let second = lock.acquire(&name("a"), Duration::ZERO, TTL).await;
        assert!(
            matches!(second, Ok(None)),
            "held lock must not be taken twice"
        );
        assert!(first.release().await.is_ok());
        let third = lock.acquire(&name("a"), Duration::ZERO, TTL).await;
        assert!(matches!(third, Ok(Some(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_gives_up_after_the_budget_and_leaves_no_entry() {
        let lock = LocalLock::new();
        let held = lock.acquire(&name("a"), Duration::ZERO, TTL).await;
        let held = held.ok().flatten().expect("taken");
        let started = tokio::time::Instant::now();
        let waited = lock.acquire(&name("a"), Duration::from_secs(5), TTL).await;
        assert!(matches!(waited, Ok(None)));
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert_eq!(lock.len(), 1, "only the holder's entry remains");
        drop(held);
        assert!(lock.is_empty());
    }

    #[tokio::test]
    async fn release_wakes_the_waiter() {
        let lock = LocalLock::new();
        let held = lock.acquire(&name("a"), Duration::ZERO, TTL).await;
        let held = held.ok().flatten().expect("taken");
        let waiter = {
            let lock = lock.clone();
            tokio::spawn(async move {
                lock.acquire(&name("a"), Duration::from_secs(3600), TTL)
                    .await
            })
        };
        // Let the waiter queue up, then release.
        while lock.queue_len(&name("a")) < 2 {
            tokio::task::yield_now().await;
        }
        assert!(held.release().await.is_ok());
        let got = waiter.await.expect("waiter task");
        assert!(matches!(got, Ok(Some(_))));
    }

    #[tokio::test]
    async fn dropped_waiter_leaves_no_entry() {
        let lock = LocalLock::new();
        let held = lock.acquire(&name("a"), Duration::ZERO, TTL).await;
        let held = held.ok().flatten().expect("taken");
        {
            let a = name("a");
            let fut = lock.acquire(&a, Duration::from_secs(3600), TTL);
            // Poll once so it queues, then drop it.
            let _ = futures_poll_once(fut).await;
        }
        drop(held);
        assert!(lock.is_empty());
    }

    async fn futures_poll_once<F: std::future::Future>(fut: F) -> Option<F::Output> {
        let mut fut = std::pin::pin!(fut);
        std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => std::task::Poll::Ready(Some(v)),
            std::task::Poll::Pending => std::task::Poll::Ready(None),
        })
        .await
    }
}
