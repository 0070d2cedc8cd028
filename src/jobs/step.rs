//! One attempt of the engine for jobs: take jobs (or a leased job to finish), run them, record
//! how they ended — so the commit carries the evidence of locked writes and a transient failure
//! runs the attempt again. The parts of the step: `take.rs`, `finish.rs`, `attempt.rs`,
//! `record.rs`, `cancel.rs`; `run.rs` runs a step to its end (here or on a held connection).

use std::{collections::HashMap, sync::atomic::AtomicBool, time::Duration};

use sea_orm::{DatabaseTransaction, DbErr};

use super::{
    context::Context,
    deferred::Deferred,
    job::{JobFailure, JobId, JobOutcome, JobRun, Raw},
    kinds::Runner,
    leased::{Claimed, Finishing, Output},
    retry::Retry,
};
use crate::{
    commit::Plan,
    db::txn::Txn,
    error::{Result, database},
    identity_map::Change,
    schema::JOB_TABLE,
    write::{
        engine::{End, Step, Tried, Worked},
        locking::Locking,
    },
};

/// Where an attempt of the engine gets its jobs.
pub(super) enum Source<'a> {
    /// Takes up to `limit` due jobs: runs those of kinds that run in the transaction, claims
    /// those of leased kinds. With `follow` (a key hash) and a limit of one, the next job of
    /// that key comes first when it is due: a worker follows the key whose job it just
    /// finished, so a hot key's chain never waits for a free worker. With `chain` and a limit
    /// of one, a keyed job that completed is followed by its key's next jobs in the same
    /// transaction (up to [`CHAIN_JOBS`](super::take::CHAIN_JOBS) jobs while the transaction is younger than
    /// [`CHAIN_FOR`](super::take::CHAIN_FOR)), locked by one statement and completed by the transaction's completion:
    /// a hot key's short jobs share a commit, and send nothing between them, instead of paying
    /// `COMMIT`, `BEGIN` and a take each. `stop`: set when the loop that runs the step
    /// ([`Worker::run`](super::Worker::run)) was told to stop: the step runs no job it did not
    /// take before (`flights/pretake.rs`).
    Take {
        limit: u32,
        follow: Option<&'a [u8]>,
        chain: bool,
        #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
        stop: Option<&'a AtomicBool>,
    },
    /// Finishes a leased job whose work ended, fenced by its claim.
    Finish(&'a Finishing),
}

/// One attempt of the engine: take jobs (or a leased job to finish), run them, record how they
/// ended.
pub(super) struct JobStep<'w> {
    pub(super) cx: &'w Context,
    pub(super) source: Source<'w>,
    pub(super) measured: Vec<Measured>,
    /// The jobs of leased kinds this attempt claimed: their work runs after its commit.
    pub(super) claimed: Vec<Claimed>,
    /// The key whose next job this attempt readied, for the worker to follow.
    pub(super) follow: Option<Vec<u8>>,
    /// Whether each handler runs in a savepoint of its own. The first attempt runs them in the
    /// job's transaction itself (no `SAVEPOINT`/`RELEASE` round trips); a handler that fails
    /// there spoils the transaction, which rolls back, and the attempts after it use savepoints.
    pub(super) savepoints: bool,
    /// Jobs whose handler failed in a transaction that rolled back for it (see `savepoints`),
    /// with the attempt and how it failed: when the next attempt takes the job again at that
    /// attempt, it records the failure instead of running the handler twice.
    pub(super) spoiled: HashMap<JobId, (u32, JobFailure, Retry)>,
    /// Jobs whose completion found a request to stop them ([`crate::jobs::cancel`]): the
    /// transaction that ran them rolled back, and the next attempt cancels them (`cancel.rs`).
    pub(super) cancelling: Vec<JobId>,
    /// A leased job's finish found its claim gone at the completion (`finish.rs`): the
    /// transaction rolled back, and the next attempt checks the claim first and reports why.
    pub(super) recheck: bool,
    /// In a held attempt (`flights/`), the commit's evidence plan, for the completion.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(super) plan: Option<Plan>,
    /// In a held attempt, the completion to send with the `COMMIT`.
    pub(super) deferred: Option<Deferred>,
    /// Whether a held attempt may send the next take after its `COMMIT` (`flights/pretake.rs`).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(super) send_ahead: bool,
    /// The transaction a held attempt began after its `COMMIT`, its take sent, with the plan
    /// of its evidence (what that message read for it): the next attempt's.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(super) ahead: Option<(crate::db::held::Held, Option<Plan>)>,
}

impl<'w> JobStep<'w> {
    /// A step from `source`, before its first attempt.
    pub(super) fn new(cx: &'w Context, source: Source<'w>) -> Self {
        Self {
            cx,
            source,
            measured: Vec::new(),
            claimed: Vec::new(),
            follow: None,
            savepoints: false,
            spoiled: HashMap::new(),
            cancelling: Vec::new(),
            recheck: false,
            plan: None,
            deferred: None,
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            send_ahead: false,
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            ahead: None,
        }
    }
}

pub(super) type Attempted = (Txn, Worked<Vec<JobRun>>);

/// The database failed doing `.0` (the attempt rolls back and may run again).
pub(super) type Failed = (&'static str, DbErr);

pub(super) fn undone(txn: Txn, (operation, e): Failed) -> Attempted {
    let error = database(operation, &JOB_TABLE, e);
    (txn, Worked::Undone(Tried::failed(error)))
}

/// What an attempt did before recording.
pub(super) enum Did {
    /// Nothing to commit: these runs are reported and the transaction rolls back.
    Nothing(Vec<JobRun>),
    /// These jobs' attempts ended, to record in the transaction (and maybe some were claimed).
    Ended(Vec<Ended>),
    /// A handler that ran without a savepoint failed (see `JobStep::spoiled`): the
    /// transaction rolls back and the attempt runs again.
    Spoiled,
    /// A leased job's claim did not hold when its finish wrote (see `JobStep::recheck`): the
    /// transaction rolls back and the attempt runs again, checking the claim first.
    Unheld,
}

/// A job whose attempt ended in this transaction, to record there.
pub(super) struct Ended {
    pub(super) id: JobId,
    pub(super) kind: String,
    pub(super) key: Option<Vec<u8>>,
    pub(super) attempt: u32,
    /// Milliseconds since it was due, when it was taken.
    pub(super) waited: i64,
    pub(super) outcome: JobOutcome,
    /// The cache changes its writes make on commit.
    pub(super) effects: Vec<Change>,
    pub(super) ran: Duration,
    pub(super) span: Option<tracing::Span>,
}

impl Step for JobStep<'_> {
    type Output = Vec<JobRun>;

    async fn run(
        &mut self,
        txn: DatabaseTransaction,
        _lockings: &mut [Locking],
    ) -> (DatabaseTransaction, Worked<Vec<JobRun>>) {
        let (txn, worked) = self.run_on(Txn::from(txn)).await;
        (txn.into_sea(), worked)
    }

    fn lease_lost(&mut self) -> Vec<JobRun> {
        // The engine holds no lock for jobs: a job's row lock lasts as long as its transaction,
        // a leased job's claim is checked by the finish itself.
        Vec::new()
    }

    /// The attempt's metrics, once its transaction committed (an attempt run again after a
    /// failed commit is counted once).
    fn ended(&mut self, _lockings: &[Locking], ended: &Result<()>) {
        self.metrics(ended.is_ok());
    }
}

impl JobStep<'_> {
    /// One attempt in `txn` (the engine's, or a held connection's: `flights/`): take jobs (or
    /// a leased job to finish), run them, record how they ended; `txn` handed back.
    pub(super) async fn run_on(&mut self, txn: Txn) -> Attempted {
        self.measured.clear();
        self.claimed.clear();
        self.follow = None;
        if !self.cancelling.is_empty() {
            return self.cancel_requested(txn).await;
        }
        let (txn, did) = match self.source {
            Source::Take {
                limit,
                follow,
                chain,
                ..
            } => self.take(txn, limit, follow, chain).await,
            Source::Finish(finishing) => self.finish(txn, finishing).await,
        };
        let ended = match did {
            Ok(Did::Spoiled) => {
                // A handler failed with its writes in the transaction: roll it all back, and
                // run the attempt again at once with a savepoint per handler (not counted as a
                // try of the engine's: nothing was wrong with the database).
                self.savepoints = true;
                return (txn, Worked::Undone(Tried::Uncounted));
            }
            Ok(Did::Unheld) => {
                self.recheck = true;
                return (txn, Worked::Undone(Tried::Uncounted));
            }
            Ok(Did::Ended(ended)) if !ended.is_empty() || !self.claimed.is_empty() => ended,
            Ok(Did::Ended(_)) => Vec::new(),
            Ok(Did::Nothing(runs)) => {
                let worked = Worked::Kept {
                    value: runs,
                    end: End::RollBack,
                    effects: Vec::new(),
                };
                return (txn, worked);
            }
            Err(failed) => return undone(txn, failed),
        };
        let worked = match self.record(&txn, ended).await {
            Ok(worked) => worked,
            Err(failed) => return undone(txn, failed),
        };
        (txn, worked)
    }

    /// The attempt's metrics, once its transaction committed (`committed`; an attempt run again
    /// after a failed commit is counted once).
    pub(super) fn metrics(&mut self, committed: bool) {
        if !committed {
            self.measured.clear();
            return;
        }
        for measured in self.measured.drain(..) {
            let Measured {
                kind,
                outcome,
                waited,
                ran,
                ended_on,
            } = measured;
            crate::metrics::job(&kind, outcome, waited, ran);
            if let Some(attempt) = ended_on {
                crate::metrics::job_ended(&kind, attempt);
            }
        }
    }
}

/// What an attempt records in the metrics when it commits.
pub(super) struct Measured {
    pub(super) kind: String,
    pub(super) outcome: &'static str,
    pub(super) waited: Duration,
    pub(super) ran: Duration,
    /// The attempt the job ended on (completed or failed for good).
    pub(super) ended_on: Option<u32>,
}

/// Where a handler's work in the job's transaction comes from.
pub(super) enum Start<'a> {
    /// A kind that runs in the transaction.
    InTx(&'a Runner, Raw<'a>),
    /// A leased kind's finish, with its work's output (which carries the finish).
    Finish(Raw<'a>, &'a Output),
}

/// How a handler's run in the job's transaction ended, for `take` and `finish`.
pub(super) enum Ran {
    /// The job's attempt ended so (its writes, if it succeeded, are in the transaction).
    Ended(JobOutcome, Vec<Change>),
    /// It failed without a savepoint: its writes spoil the transaction (see
    /// `JobStep::spoiled`).
    Spoiled,
}

/// A job's wait as stored (milliseconds) as a duration.
pub(super) fn waited(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
