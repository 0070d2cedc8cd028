//! A `table` lease handed over only once it has run out: the "holder paused past its TTL" case,
//! every time, without sleeping.

use std::time::Duration;

use freshlock::lock::backend::{LeaseLock, LockGuard, LockRole};
use freshlock::lock::{LockName, TableLock};
use freshlock::{LockBackend, LockError};

/// Waits (on the database clock, by polling the lease itself) until the lease has expired before
/// handing it over.
#[derive(Debug)]
pub struct ExpiresBeforeUse(pub TableLock);

impl LockBackend for ExpiresBeforeUse {
    fn queue(&self) -> Option<&dyn LockBackend> {
        self.0.queue()
    }

    fn kind(&self) -> freshlock::LockKind {
        freshlock::LockKind::Table
    }

    fn role(&self) -> LockRole<'_> {
        LockRole::Lease(self)
    }
}

#[async_trait::async_trait]
impl LeaseLock for ExpiresBeforeUse {
    async fn acquire(
        &self,
        name: &LockName,
        wait: Duration,
        ttl: Duration,
    ) -> Result<Option<Box<dyn LockGuard>>, LockError> {
        let guard = self.0.acquire(name, wait, ttl).await?;
        if let Some(guard) = &guard {
            // `extend` only succeeds while unexpired: poll until the database says it has run out.
            while guard.extend(Duration::from_millis(1)).await? {
                tokio::task::yield_now().await;
            }
        }
        Ok(guard)
    }
}
