//! How hard to try for a lock, and what to do without it.

use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, warn};

use super::{
    name::LockName,
    traits::{Acquired, LeaseLock},
};
use crate::error::Error;

/// What `locked_update` does when the lock could not be taken within the policy's tries.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLockFailure {
    /// Go on without the lock, as the Drupal report's best-effort lock does. This is safe for the
    /// row itself: the reload and the write run in one transaction that holds the row's write lock
    /// (`BEGIN IMMEDIATE` on SQLite, `FOR UPDATE` elsewhere), so nothing another writer committed is
    /// overwritten. The returned report says the lock was not held, and a warning is logged.
    Proceed,
    /// Give up with [`Error::LockNotAcquired`].
    Fail,
}

/// How a session takes locks: tries, wait per try, lease TTL and the fallback.
///
/// The default mirrors the Drupal report: 6 tries × 5 s wait, a 60 s lease, and proceed without
/// the lock when it cannot be had.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockPolicy {
    /// How many times to try for the lock (at least 1), each waiting up to `wait_per_try`.
    pub lock_tries: u32,
    /// How long one try may wait for the lock. Zero: a try does not wait.
    pub wait_per_try: Duration,
    /// How long a lease lives if its holder disappears (server-side backends).
    pub ttl: Duration,
    /// What to do when every try failed.
    pub on_failure: OnLockFailure,
    /// How many times a write (`locked_update` and the other locked writes, and
    /// `run_retrying` sections) runs its locked section at most (at least 1): a write
    /// refused by the optimistic guard (the row changed since it was read) and a transient
    /// database error (deadlock, serialization failure, lock timeout, busy SQLite, lost
    /// connection) each start it again — reload, `apply`, write — after a short jittered backoff.
    pub write_attempts: u32,
    /// How long a locked write waits for one reply of the database (a statement, `BEGIN`,
    /// `COMMIT`) before it drops the connection: a lost `COMMIT` reply is then resolved on
    /// another connection, and an earlier one runs the section again. `None` (the default): a
    /// third of [`ttl`](Self::ttl), between 1 s and 10 s. See
    /// [`reply_deadline`](Self::reply_deadline).
    pub reply_timeout: Option<Duration>,
}

impl Default for LockPolicy {
    fn default() -> Self {
        Self {
            lock_tries: 6,
            wait_per_try: Duration::from_secs(5),
            ttl: Duration::from_secs(60),
            on_failure: OnLockFailure::Proceed,
            write_attempts: 5,
            reply_timeout: None,
        }
    }
}

impl LockPolicy {
    /// Sets how long one reply of the database may take ([`reply_timeout`](Self::reply_timeout)).
    pub fn with_reply_timeout(mut self, bound: Duration) -> Self {
        self.reply_timeout = Some(bound);
        self
    }

    /// The bound on each round trip of a locked write: [`reply_timeout`](Self::reply_timeout),
    /// or a third of the lease's TTL between 1 s and 10 s — so a silent network partition frees
    /// the key well before the lease would run out (the default policy: 10 s).
    pub fn reply_deadline(&self) -> Duration {
        self.reply_timeout
            .unwrap_or_else(|| crate::db::deadline::reply_bound(self.ttl))
    }

    crate::setters::setters! {
        /// Sets how many times to try for the lock ([`lock_tries`](Self::lock_tries)).
        with_lock_tries(tries: u32) => lock_tries = tries;

        /// Sets the wait per try.
        with_wait_per_try(wait: Duration) => wait_per_try = wait;

        /// Sets the lease TTL.
        with_ttl(ttl: Duration) => ttl = ttl;

        /// Sets what happens when the lock cannot be had.
        with_on_failure(on_failure: OnLockFailure) => on_failure = on_failure;

        /// Sets how many times the locked section may run (conflicts and transient errors).
        with_write_attempts(attempts: u32) => write_attempts = attempts;
    }

    /// Checks the policy.
    ///
    /// # Errors
    /// [`Error::InvalidPolicy`] when `lock_tries` or `write_attempts` is 0, or `ttl` or
    /// `reply_timeout` is zero (no reply could come within it: every write would fail, or be
    /// left in doubt at its `COMMIT`).
    pub fn validate(&self) -> Result<(), Error> {
        if self.write_attempts == 0 {
            return Err(Error::InvalidPolicy {
                reason: "write_attempts must be at least 1",
            });
        }
        if self.lock_tries == 0 {
            return Err(Error::InvalidPolicy {
                reason: "lock_tries must be at least 1",
            });
        }
        if self.ttl.is_zero() {
            return Err(Error::InvalidPolicy {
                reason: "ttl must be longer than zero",
            });
        }
        if self.reply_timeout.is_some_and(|bound| bound.is_zero()) {
            return Err(Error::InvalidPolicy {
                reason: "reply_timeout must be longer than zero",
            });
        }
        Ok(())
    }

    /// Tries for the lease lock `name` on `lease` (of the backend `kind`) as this policy says.
    pub(crate) async fn acquire(
        &self,
        kind: &'static str,
        lease: &dyn LeaseLock,
        name: &LockName,
    ) -> Acquisition {
        let started = Instant::now();
        let mut tries = 0;
        let mut result = Ok(None);
        while tries < self.lock_tries.max(1) {
            tries += 1;
            // The engine's leases are checked in the transaction of each write they guard.
            result = lease
                .acquire_checked(name, self.wait_per_try, self.ttl)
                .await;
            match &result {
                Ok(Some(_)) => break,
                Ok(None) => debug!(lock = %name, tries, "lock busy"),
                // A failing backend is not asked again: its failure is reported as it is.
                Err(error) => {
                    warn!(lock = %name, backend = kind, %error, "lock backend failed");
                    break;
                }
            }
        }
        Acquisition {
            result,
            tries,
            waited: started.elapsed(),
        }
    }
}

/// What one [`LockPolicy::acquire`] got.
#[derive(Debug)]
pub(crate) struct Acquisition {
    /// The guard, `None` when every try found the lock busy, or the backend's error.
    pub(crate) result: Acquired,
    /// Tries made.
    pub(crate) tries: u32,
    /// Time spent trying.
    pub(crate) waited: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_mirrors_the_seed() {
        let policy = LockPolicy::default();
        assert_eq!(policy.lock_tries, 6);
        assert_eq!(policy.wait_per_try, Duration::from_secs(5));
        assert_eq!(policy.ttl, Duration::from_secs(60));
        assert_eq!(policy.on_failure, OnLockFailure::Proceed);
        assert!(policy.validate().is_ok());
    }

    #[test]
    fn zero_tries_and_zero_ttl_are_rejected() {
        let zero_tries = LockPolicy::default().with_lock_tries(0);
        assert!(matches!(
            zero_tries.validate(),
            Err(Error::InvalidPolicy { .. })
        ));
        let zero_ttl = LockPolicy::default().with_ttl(Duration::ZERO);
        assert!(matches!(
            zero_ttl.validate(),
            Err(Error::InvalidPolicy { .. })
        ));
    }

    #[test]
    fn a_zero_reply_timeout_is_rejected() {
        let zero = LockPolicy::default().with_reply_timeout(Duration::ZERO);
        assert!(matches!(
            zero.validate(),
            Err(Error::InvalidPolicy { reason }) if reason.contains("reply_timeout")
        ));
        let short = LockPolicy::default().with_reply_timeout(Duration::from_millis(1));
        assert!(short.validate().is_ok());
    }
}
