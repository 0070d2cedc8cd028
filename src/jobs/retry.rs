//! How a kind's failed attempts are retried ([`RetryPolicy`]), and whether one failure may be.

use std::{fmt, hash::BuildHasher, sync::Arc, time::Duration};

use tracing::warn;

use super::job::{JobFailure, JobId, JobOutcome};
use crate::error::ApplyError;

/// How a kind's failed attempts are retried: Celery's `max_retries`, `retry_backoff` and
/// `autoretry_for`, per kind.
#[derive(Clone)]
pub struct RetryPolicy {
    pub(super) max_attempts: u32,
    base: Duration,
    cap: Duration,
    retry_if: Option<Arc<RetryIf>>,
}

/// A kind's test of which handler errors retry.
type RetryIf = dyn Fn(&ApplyError) -> bool + Send + Sync;

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("max_attempts", &self.max_attempts)
            .field("base", &self.base)
            .field("cap", &self.cap)
            .field("retry_if", &self.retry_if.is_some())
            .finish()
    }
}

impl Default for RetryPolicy {
    /// Four attempts (Celery's `max_retries=3`), backoff from 1 s doubling up to 10 min, with
    /// full jitter; every error retries.
    fn default() -> Self {
        Self {
            max_attempts: 4,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(600),
            retry_if: None,
        }
    }
}

impl RetryPolicy {
    /// How many attempts a job gets in all (at least 1: a job is always tried once).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The backoff: attempt `n`'s retry is due after a random delay up to `base × 2ⁿ⁻¹`, never
    /// more than `cap` (full jitter, so that a burst of failures does not retry in step).
    pub fn with_backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.base = base;
        self.cap = cap.max(base);
        self
    }

    /// Which handler errors retry (Celery's `autoretry_for`): an error for which `retry` is
    /// false fails the job at once. `retry` sees the error the handler (or a leased kind's work
    /// or finish) returned, as it returned it: [`ApplyError::downcast_ref`] finds your own
    /// error type in it. A panic always counts as a failed attempt that retries.
    ///
    /// ```
    /// use freshlock::jobs::RetryPolicy;
    ///
    /// #[derive(Debug, thiserror::Error)]
    /// #[error("the card was declined")]
    /// struct Declined;
    ///
    /// // A declined card never succeeds on a retry; anything else (a timeout) may.
    /// let policy = RetryPolicy::default().retry_if(|error| error.downcast_ref::<Declined>().is_none());
    /// # let _ = policy;
    /// ```
    pub fn retry_if(mut self, retry: impl Fn(&ApplyError) -> bool + Send + Sync + 'static) -> Self {
        self.retry_if = Some(Arc::new(retry));
        self
    }

    /// The delay before the retry that follows failed attempt `attempt` of job `id`, or `None`
    /// when no attempt is left.
    fn retry_after(&self, id: JobId, attempt: u32) -> Option<Duration> {
        if attempt >= self.max_attempts {
            return None;
        }
        let doubled = self
            .base
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(30));
        let ceiling = doubled.min(self.cap);
        // Full jitter from the process's randomly keyed hasher: no random-number crate needed.
        let draw = std::collections::hash_map::RandomState::new().hash_one((id, attempt));
        let fraction = (draw >> 11) as f64 / (1u64 << 53) as f64;
        Some(ceiling.mul_f64(fraction))
    }
}

/// Whether one failed attempt may run again (if its kind's policy has attempts left).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Retry {
    /// It may: a panic, a refused guarded write, a handler error the kind's `retry_if` accepts.
    Allowed,
    /// It never does: bad input (a payload that does not deserialize, a kind no longer handled), or a
    /// handler error the kind's `retry_if` refuses.
    Never,
}

impl RetryPolicy {
    /// Whether a handler's `error` retries under this policy (its `retry_if`; every error
    /// without one).
    pub(super) fn retries(&self, error: &ApplyError) -> Retry {
        if (self.retry_if.as_ref()).is_none_or(|retry_if| retry_if(error)) {
            Retry::Allowed
        } else {
            Retry::Never
        }
    }
}

/// How failed attempt `attempt` of job `id` ends under `policy`: retried later (when `retry`
/// allows it and an attempt is left), or failed for good.
pub(super) fn decide(
    policy: &RetryPolicy,
    id: JobId,
    attempt: u32,
    failure: JobFailure,
    retry: Retry,
) -> JobOutcome {
    let after = match retry {
        Retry::Allowed => policy.retry_after(id, attempt),
        Retry::Never => None,
    };
    warn!(%failure, retry_after = ?after, "job attempt failed");
    match after {
        Some(after) => JobOutcome::Retrying { failure, after },
        None => JobOutcome::Failed(failure),
    }
}
