//! What every locked write does the same way, written once: the retry of an attempt after a
//! conflict or a transient error, the fence check before a write, and the release of a section's
//! locks. `locked_update`'s driver (one row, commit combining, detach on drop) and sections
//! (`with_lock`, `locked_update_many`, `locked_update_with`) both run on these; neither has a
//! retry loop, a backoff or a lease check of its own.
//!
//! The rule for cancellation is one too (`detach.rs`, stated in the README's Guarantees): a
//! locked write whose caller is dropped is polled to its end in a task of its own, never cut in
//! half — it rolls back if the caller had not yet said what to write, and commits otherwise;
//! either way its locks are released after its transaction ended. The one exception is a
//! section's `work`, which may borrow from its caller and so cannot move: dropping it rolls the
//! transaction back and releases the locks.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use sea_orm::DatabaseTransaction;
use tracing::{debug, warn};

use crate::{
    deadline::within,
    decision::Written,
    error::{Error, Result, database},
    locking::Locking,
    outcome::{LockReport, Report},
    row::Row,
};

/// How one attempt of a locked write ended, for [`Retries::settle`].
pub(crate) enum Tried<T> {
    /// With a result to report (a lost lease included).
    Done(T),
    /// Failed. `conflict`: an optimistic guard refused a write of the attempt (the error may
    /// also be [`Error::Conflict`] itself).
    Failed { error: Error, conflict: bool },
    /// Not an attempt of this write: a combined waiter's hook failed after it may have written
    /// in the transaction; it got its own error, and the attempt runs again without it (neither
    /// counted nor delayed).
    Uncounted,
}

impl<T> Tried<T> {
    /// A guard refused the attempt's write of `target`. The count in the error is filled in by
    /// [`Retries::settle`] when no attempt is left.
    pub(crate) fn conflict(target: String) -> Self {
        Self::Failed {
            error: Error::Conflict {
                target,
                attempts: 0,
            },
            conflict: true,
        }
    }
}

/// The attempts of one locked write under the locks it holds: how many ran, how many
/// conflicted, and when to run the next (a short exponential backoff with jitter, up to the
/// policy's `write_attempts`).
pub(crate) struct Retries {
    target: String,
    /// Whether a conflict or a transient error runs the attempt again (`Section::run` does not).
    retrying: bool,
    /// The entity whose conflicts are counted in the metrics, for row writes.
    entity: Option<&'static str>,
    delays: ExponentialBackoff,
    pub(crate) attempts: u32,
    pub(crate) conflicts: u32,
}

impl Retries {
    pub(crate) fn new(
        target: String,
        write_attempts: u32,
        retrying: bool,
        entity: Option<&'static str>,
    ) -> Self {
        let delays = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(2))
            .with_max_delay(Duration::from_millis(200))
            .with_jitter()
            .with_max_times(write_attempts.saturating_sub(1) as usize)
            .build();
        Self {
            target,
            retrying,
            entity,
            delays,
            attempts: 0,
            conflicts: 0,
        }
    }

    /// Counts an attempt about to run.
    pub(crate) fn start(&mut self) {
        self.attempts += 1;
    }

    /// What follows the attempt that ended as `tried`: `Some` with the write's result, or `None`
    /// to run it again (after the backoff's delay, already slept).
    pub(crate) async fn settle<T>(&mut self, tried: Result<Tried<T>>) -> Option<Result<T>> {
        let (error, conflicted) = match tried {
            Ok(Tried::Done(value)) => return Some(Ok(value)),
            Ok(Tried::Uncounted) => {
                self.attempts -= 1;
                return None;
            }
            Ok(Tried::Failed { error, conflict }) => (error, conflict),
            Err(error) => (error, false),
        };
        let conflict = conflicted || matches!(error, Error::Conflict { .. });
        if conflict {
            self.conflicts += 1;
            if let Some(entity) = self.entity {
                crate::metrics::conflict(entity);
            }
        }
        let again = self.retrying && (conflict || error.is_transient());
        match again.then(|| self.delays.next()).flatten() {
            Some(delay) => {
                let (target, attempts) = (&self.target, self.attempts);
                if conflict {
                    warn!(%target, attempts, "conflict: the row changed since it was read");
                } else {
                    warn!(%target, attempts, %error, "transient database error");
                }
                debug!(%target, ?delay, "running the locked section again");
                tokio::time::sleep(delay).await;
                None
            }
            None if self.retrying && conflict => Some(Err(Error::Conflict {
                target: self.target.clone(),
                attempts: self.attempts,
            })),
            None => Some(Err(error)),
        }
    }
}

/// The fence check of `locking` in the write's transaction, before anything is written: whether
/// its lease (if any) is still this write's. `releasing`: a backend that can also releases the
/// lease in `txn`, so the commit ends it (see [`Locking::verify`]). A lost lease is logged and
/// counted here; the caller rolls back and reports it.
pub(crate) async fn fence(
    txn: &DatabaseTransaction,
    locking: &mut Locking,
    releasing: bool,
    target: &str,
) -> Result<bool> {
    match locking.verify(txn, releasing).await {
        Ok(true) => Ok(true),
        Ok(false) => {
            let fence = locking.report.fence;
            warn!(%target, lock = %locking.report.name, fence, "lease lost before the write; nothing written");
            crate::metrics::lease_lost(locking.report.backend.as_str());
            Ok(false)
        }
        Err(source) => Err(Error::Lock {
            target: target.to_owned(),
            source,
        }),
    }
}

/// Releases every lock (last taken first), after the transaction ended; their reports in the
/// order they were taken.
pub(crate) async fn release_all(lockings: Vec<Locking>) -> Vec<LockReport> {
    let mut reports = Vec::with_capacity(lockings.len());
    for locking in lockings.into_iter().rev() {
        reports.push(locking.release().await);
    }
    reports.reverse();
    reports
}

/// Records how a row write of `entity` ended: the current span's fields (the driver's
/// `locked_update` span) and the `update` metric.
pub(crate) fn record<M>(entity: &'static str, result: &Result<Report<Written<M>>>) {
    let span = tracing::Span::current();
    let outcome = match result {
        Ok(report) => {
            span.record("lock_wait_ms", report.lock.waited.as_secs_f64() * 1e3);
            span.record("lock_held", report.lock.held);
            span.record("attempts", report.attempts);
            span.record("conflicts", report.conflicts);
            report.outcome.name()
        }
        Err(Error::Interrupted { .. }) => "interrupted",
        Err(Error::Conflict { .. }) => "conflict",
        Err(Error::LockNotAcquired { .. }) => "lock_not_acquired",
        Err(_) => "error",
    };
    span.record("outcome", outcome);
    crate::metrics::update(entity, outcome);
}

/// How [`finish`] ends a transaction that wrote nothing.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum End {
    Commit,
    RollBack,
}

/// Ends a transaction that wrote nothing as `end` says, waiting at most `reply` (see
/// `deadline.rs`).
pub(crate) async fn finish(
    txn: DatabaseTransaction,
    end: End,
    row: &Row,
    reply: Duration,
) -> Result<()> {
    let ended = match end {
        End::Commit => within(reply, txn.commit()).await,
        End::RollBack => within(reply, txn.rollback()).await,
    };
    ended.map_err(|e| database("committing", row, e))
}
