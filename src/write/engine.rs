//! The one engine every locked write runs on: under the locks a front end took, it runs
//! *attempts* — begin the transaction (transaction-scoped locks are taken in it), run the write's
//! [`Step`], check every lease's fence, commit with the in-doubt evidence, apply the cache effects
//! — and runs them again after a conflict or a transient error ([`Retries`]), then releases the
//! locks ([`release_all`]). A step only says what it did in the transaction ([`Worked`]); the
//! fence check, the commit and its evidence, the cache and the retry each exist once, here.
//!
//! The steps: a section's work (`section.rs`: [`Session::with_lock`](crate::Session::with_lock),
//! sections), a row's reload-decide-write (`row_step.rs`: `locked_update`, `locked_delete`,
//! `get_or_insert`, `update_or_insert`) and several rows' (`rows_step.rs`: `locked_update_many`,
//! `_pair`, `_with`), the last two writing each row by the same code (`row_write.rs`). The front
//! ends differ only in how they take their locks: a section and the rows' write take all of
//! theirs in one canonical order; `locked_update`'s driver takes its row's lock while seated in
//! the row's room, where commit combining (`combine.rs`) may serve it instead.
//!
//! The rule for cancellation is one too (`detach.rs`, stated in the guide's guarantees page): a
//! locked write whose caller is dropped is polled to its end in a task of its own, never cut in
//! half — it rolls back if the caller had not yet said what to write, and commits otherwise;
//! either way its locks are released after its transaction ended. The one exception is a
//! section's `work`, which may borrow from its caller and so cannot move: dropping it rolls the
//! transaction back and releases the locks.

use std::{future::Future, time::Duration};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use sea_orm::DatabaseTransaction;
use tracing::{debug, warn};

use crate::{
    commit::{self, Evidence},
    db::{deadline::within, pool::Pool},
    error::{Error, Result, database},
    identity_map::{Change, IdentityMap},
    outcome::{LockReport, Report},
    write::decision::Written,
    write::locking::Locking,
};

/// How one attempt of a locked write ended, for [`Retries::settle`].
pub(crate) enum Tried<T> {
    /// With a result to report (a lost lease included).
    Done(T),
    /// Failed. `conflict`: an optimistic guard refused a write of the attempt (the error may
    /// also be [`Error::Conflict`] itself).
    Failed { error: Error, conflict: bool },
    /// Not an attempt of this write, rolled back and run again at once (neither counted nor
    /// delayed): a combined waiter's hook failed after it may have written in the transaction
    /// (it got its own error, and the attempt runs without it), or a lock tried in the step's
    /// first statement was not had (the attempt takes it with a statement of its own).
    Uncounted,
}

impl<T> Tried<T> {
    /// The attempt failed with `error` (run again if it is transient, when retrying).
    pub(crate) fn failed(error: Error) -> Self {
        Self::Failed {
            error,
            conflict: false,
        }
    }

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

/// The fence check of every lock in `lockings`, in the write's transaction, before its commit:
/// whether each lease (if any) is still this write's; a backend that can also releases the lease
/// in `txn`, so the commit ends it (see [`Locking::verify`]). A lost lease is logged and counted
/// here; the caller rolls back and reports it.
pub(crate) async fn fences(
    txn: &DatabaseTransaction,
    lockings: &mut [Locking],
    target: &str,
) -> Result<bool> {
    for locking in lockings.iter_mut() {
        match locking.verify(txn).await {
            Ok(true) => {}
            Ok(false) => {
                let fence = locking.report.fence;
                warn!(%target, lock = %locking.report.name, fence, "lease lost before the write; nothing written");
                crate::metrics::lease_lost(locking.report.backend.as_str());
                return Ok(false);
            }
            Err(source) => {
                return Err(Error::Lock {
                    target: target.to_owned(),
                    source,
                });
            }
        }
    }
    Ok(true)
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

/// How a transaction that wrote nothing ends.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum End {
    Commit,
    RollBack,
}

/// Whether the leases are checked before a step's commit, and how.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fence {
    /// Every lease is checked and, where its backend can, released in the transaction, so the
    /// commit ends it.
    Releasing,
    /// Checked by the step itself with [`fences`], before it wrote (a row write: a lost lease
    /// sends no UPDATE).
    Checked,
    /// Not checked: the write cannot overwrite anything (an insert; a concurrent creator makes
    /// it fail on the key).
    Unchecked,
}

/// What a [`Step`] did in the attempt's transaction, for the engine to end it.
pub(crate) enum Worked<T> {
    /// It wrote (or may have): check the fences as `fence` says, commit with `evidence` (taken
    /// at the commit, as the session's `commit_markers` says, when `None`), then make `effects`
    /// in the cache; `value` is the attempt's result.
    Write {
        value: T,
        evidence: Option<Evidence>,
        fence: Fence,
        effects: Vec<Change>,
    },
    /// It wrote nothing: end the transaction as `end` says (no fence check, no evidence), then
    /// make `effects`.
    Kept {
        value: T,
        end: End,
        effects: Vec<Change>,
    },
    /// Roll the transaction back; the attempt ended as this says.
    Undone(Tried<T>),
}

/// One locked write's work in a transaction, run by [`run`] once per attempt.
pub(crate) trait Step: Send {
    /// What an attempt that ended gives.
    type Output: Send;

    /// Runs the write in `txn` (begun under `lockings`) and hands the transaction back with what
    /// it did.
    fn run(
        &mut self,
        txn: DatabaseTransaction,
        lockings: &mut [Locking],
    ) -> impl Future<Output = (DatabaseTransaction, Worked<Self::Output>)> + Send;

    /// The result when a lease was lost before the commit (rolled back, nothing written).
    fn lease_lost(&mut self) -> Self::Output;

    /// Whether the step's first statement tries a single `pg_advisory` or `row` lock itself (see
    /// [`Locking::folding`]): then `BEGIN` sends no lock statement of its own.
    fn folds_lock(&self) -> bool {
        false
    }

    /// The transaction of a [`Worked::Write`] or [`Worked::Kept`] ended as `ended` says (after
    /// the cache effects of a commit; before any lock is released).
    fn ended(&mut self, _lockings: &[Locking], _ended: &Result<()>) {}
}

/// What the engine needs of the session a write runs in: its connection, its cache, and whether
/// it takes commit markers (the bound on each reply is the locks' policy's).
#[derive(Clone, Copy)]
pub(crate) struct Engine<'a> {
    pub(crate) db: &'a Pool,
    pub(crate) map: &'a IdentityMap,
    pub(crate) markers: bool,
}

/// Runs `step`'s attempts under `lockings` (taken by the caller, who releases them after) until
/// one settles, as `retries` says; `label` names the write in logs and errors. `detached`: each
/// `BEGIN` runs in a task of its own (for callers that may be dropped; see
/// [`Locking::begin_all`]).
pub(crate) async fn run<S: Step>(
    engine: Engine<'_>,
    lockings: &mut [Locking],
    retries: &mut Retries,
    label: &str,
    detached: bool,
    step: &mut S,
) -> Result<S::Output> {
    loop {
        retries.start();
        let tried = attempt(engine, lockings, label, detached, step).await;
        if let Some(result) = retries.settle(tried).await {
            return result;
        }
    }
}

/// One attempt: begin (locking in the transaction where the backend does), the step, the fence
/// checks, the commit with its evidence, the cache effects.
async fn attempt<S: Step>(
    engine: Engine<'_>,
    lockings: &mut [Locking],
    label: &str,
    detached: bool,
    step: &mut S,
) -> Result<Tried<S::Output>> {
    let db = engine.db;
    let reply = (lockings.first()).map_or(crate::db::deadline::DEFAULT_REPLY, |l| l.reply);
    let txn = Locking::begin_all(lockings, db, detached, step.folds_lock()).await?;
    let (txn, worked) = step.run(txn, lockings).await;
    let (value, ended, effects) = match worked {
        Worked::Undone(tried) => {
            let silent = matches!(&tried, Tried::Failed { error, .. } if error.is_no_reply());
            crate::db::own::rollback_after(txn, reply, silent).await;
            return Ok(tried);
        }
        Worked::Kept {
            value,
            end,
            effects,
        } => {
            let ended = match end {
                End::Commit => within(reply, txn.commit()).await,
                End::RollBack => within(reply, txn.rollback()).await,
            };
            // A lease freed by the step's first statement (see `Locking::folding`) ends with
            // a commit that wrote nothing else, too.
            if end == End::Commit && ended.is_ok() {
                lockings.iter_mut().for_each(Locking::committed);
            }
            (
                value,
                ended.map_err(|e| database("committing", &label, e)),
                effects,
            )
        }
        Worked::Write {
            value,
            evidence,
            fence,
            effects,
        } => {
            if fence == Fence::Releasing {
                let held = fences(&txn, lockings, label).await;
                if !matches!(held, Ok(true)) {
                    crate::db::own::rollback(txn, reply).await;
                    return held.map(|_| Tried::Done(step.lease_lost()));
                }
            }
            let committed = match &evidence {
                Some(evidence) => commit::commit(txn, evidence, db, label, reply).await,
                None => commit::commit_write(txn, engine.markers, db, label, reply).await,
            };
            if committed.is_ok() {
                lockings.iter_mut().for_each(Locking::committed);
            }
            (value, committed, effects)
        }
    };
    if ended.is_ok() {
        engine.map.apply(effects);
    }
    step.ended(lockings, &ended);
    ended.map(|()| Tried::Done(value))
}
