//! One handler's run in the job's transaction — in a savepoint of it once an attempt was
//! spoiled — its panics caught, its failure classified.

use sea_orm::DbErr;
use tracing::debug;

use super::{
    catch::{CatchUnwind, panic_message},
    job::{JobFailure, JobId, JobOutcome},
    kinds::Kind,
    retry::{Retry, decide},
    step::{Failed, JobStep, Ran, Start},
};
use crate::{
    db::{savepoint::Savepoint, txn::Txn},
    tx::Tx,
};

impl JobStep<'_> {
    /// Runs a handler's work in the job's transaction `txn` — in a savepoint of it once an
    /// attempt was spoiled (see `JobStep::savepoints`), in `txn` itself before — and hands
    /// `txn` back: how the job's attempt ended and, when it succeeded, the cache changes its
    /// writes make on commit; or `Spoiled`, when it failed without a savepoint. `Err` when the
    /// database failed around the handler, or the handler failed on a transient database error
    /// (a deadlock): the engine runs the whole attempt again.
    pub(super) async fn attempt(
        &mut self,
        txn: Txn,
        kind: &Kind,
        kind_name: &str,
        id: JobId,
        attempt: u32,
        start: Start<'_>,
    ) -> (Txn, std::result::Result<Ran, Failed>) {
        if let Some((at, failure, retries)) = self.spoiled.remove(&id)
            && at == attempt
        {
            // Its handler failed in the transaction rolled back before this one: not run twice.
            let outcome = decide(&kind.policy, id, attempt, failure, retries);
            return (txn, Ok(Ran::Ended(outcome, Vec::new())));
        }
        if !self.savepoints {
            let tx = Tx::new(txn, self.cx.session.clone());
            let ran = run_handler(&tx, kind, kind_name, start).await;
            let (txn, effects, conflicted) = tx.into_parts();
            return match failed(ran, conflicted) {
                None => {
                    debug!("job completed");
                    (txn, Ok(Ran::Ended(JobOutcome::Completed, effects)))
                }
                // Nothing of the handler's reached the transaction.
                Some((failure @ JobFailure::BadPayload { .. }, retries, _)) => {
                    let outcome = decide(&kind.policy, id, attempt, failure, retries);
                    (txn, Ok(Ran::Ended(outcome, Vec::new())))
                }
                Some((_, _, Some(handler))) if transient(&handler) => {
                    (txn, Err(("running a job's handler in", handler)))
                }
                Some((failure, retries, _)) => {
                    self.spoiled.insert(id, (attempt, failure, retries));
                    (txn, Ok(Ran::Spoiled))
                }
            };
        }
        // The savepoint's own round trips are bounded as every statement of the attempt (a
        // handler's go through its `Tx`): one whose reply never comes fails the attempt as a
        // lost connection, and the engine drops the silent connection (see `deadline.rs`).
        let reply = self.cx.reply();
        let savepoint = match Savepoint::begin(&txn, reply).await {
            Ok(savepoint) => savepoint,
            Err(e) => return (txn, Err(("starting the savepoint of", e))),
        };
        let tx = Tx::new(savepoint.lend(), self.cx.session.clone());
        let ran = run_handler(&tx, kind, kind_name, start).await;
        let (savepoint, effects, conflicted) = tx.into_parts();
        let savepoint = Savepoint::resume(savepoint, reply);
        let ended = match failed(ran, conflicted) {
            None => match savepoint.release().await {
                Ok(()) => {
                    debug!("job completed");
                    Ok(Ran::Ended(JobOutcome::Completed, effects))
                }
                Err(e) => Err(("releasing the savepoint of", e)),
            },
            // When the database ended the whole transaction (a deadlock on MySQL), the
            // savepoint is gone: the attempt fails with the handler's error, and the engine
            // runs it again if that error is transient.
            Some((failure, retries, handler)) => match savepoint.roll_back().await {
                Ok(()) => {
                    let outcome = decide(&kind.policy, id, attempt, failure, retries);
                    Ok(Ran::Ended(outcome, Vec::new()))
                }
                Err(e) => Err(match handler {
                    // A rollback without reply: the connection is silent, which the attempt
                    // must say (nothing more is sent on it).
                    Some(handler) if !crate::db::failure::is_no_reply(&e) => {
                        ("running a job's handler in", handler)
                    }
                    _ => ("rolling back the savepoint of", e),
                }),
            },
        };
        (txn, ended)
    }
}

/// How a handler's run ended: `Ok`, or why it failed, whether the failure retries and the
/// handler's own database error, if it failed with one.
type HandlerRan = std::result::Result<(), (JobFailure, Retry, Option<DbErr>)>;

/// Starts the handler of `start` on `tx` and runs it, its panics caught.
async fn run_handler(tx: &Tx, kind: &Kind, kind_name: &str, start: Start<'_>) -> HandlerRan {
    let started = match start {
        Start::InTx(run, raw) => run(tx, raw),
        Start::Finish(raw, output) => output.finish(tx, raw),
    };
    match started {
        Err(reason) => {
            let kind = kind_name.to_owned();
            Err((JobFailure::BadPayload { kind, reason }, Retry::Never, None))
        }
        Ok(work) => match CatchUnwind::new(work).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => {
                let retries = kind.policy.retries(&error);
                let error = error.into_inner();
                let failure = JobFailure::Handler(error.to_string());
                Err((failure, retries, database_error(error)))
            }
            Err(panic) => Err((
                JobFailure::Panicked(panic_message(&*panic)),
                Retry::Allowed,
                None,
            )),
        },
    }
}

/// The database error a handler failed with: its own `DbErr`, or the one inside freshlock's
/// error (a `Tx` repository's call), so a deadlock is run again as one whichever way it came
/// (a deadlock on MySQL/MariaDB that came through a repository, in a savepoint, once failed the
/// worker: its rollback to the savepoint the deadlock had ended was all that was seen).
fn database_error(error: crate::error::BoxError) -> Option<DbErr> {
    let error = match error.downcast::<DbErr>() {
        Ok(e) => return Some(*e),
        Err(error) => error,
    };
    match error.downcast::<crate::error::Error>().map(|e| *e) {
        Ok(crate::error::Error::Database { source, .. }) => {
            source.downcast::<DbErr>().ok().map(|e| *e)
        }
        _ => None,
    }
}

/// A handler's run with a refused guarded write counted as a failure: `None` when it succeeded.
fn failed(ran: HandlerRan, conflicted: bool) -> Option<(JobFailure, Retry, Option<DbErr>)> {
    match ran {
        Ok(()) if conflicted => Some((
            JobFailure::Handler("a guarded write was refused: the row changed".to_owned()),
            Retry::Allowed,
            None,
        )),
        Ok(()) => None,
        Err(failed) => Some(failed),
    }
}

/// Whether a handler's database error is one the engine runs the whole attempt again for (a
/// deadlock, a serialization failure, a lost connection before the commit).
fn transient(error: &DbErr) -> bool {
    crate::db::failure::classify(error).is_transient()
}
