//! The worker: takes the next job, runs its handler in the job's transaction, records how it
//! ended there, and commits — one attempt of the engine (`engine.rs`), so the commit carries the
//! evidence of locked writes and a transient failure runs the attempt again.

use std::{
    collections::HashMap,
    fmt,
    future::Future,
    hash::BuildHasher,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use sea_orm::{DatabaseTransaction, DbErr, TransactionTrait};
use serde::de::DeserializeOwned;
use tracing::{Instrument, debug, info_span, warn};

use super::{JobId, store};
use crate::{
    commit::Evidence,
    deadline::within,
    engine::{self, End, Engine, Fence, Retries, Step, Tried, Worked},
    error::{BoxError, Result, database},
    identity_map::Change,
    locking::Locking,
    schema::JOB_TABLE,
    section::SectionWork,
    session::Session,
    tx::Tx,
};

/// A job as its handler gets it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Job<P> {
    /// The job's id.
    pub id: JobId,
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// The job's serialization key, if it has one.
    pub key: Option<String>,
    /// The payload, deserialized.
    pub payload: P,
}

/// How a kind's failed attempts are retried: Celery's `max_retries`, `retry_backoff` and
/// `autoretry_for`, per kind.
#[derive(Clone)]
pub struct RetryPolicy {
    max_attempts: u32,
    base: Duration,
    cap: Duration,
    retry_if: Option<Arc<RetryIf>>,
}

/// A kind's test of which handler errors retry.
type RetryIf = dyn Fn(&BoxError) -> bool + Send + Sync;

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
    /// false fails the job at once. A panic always counts as a failed attempt that retries.
    pub fn retry_if(mut self, retry: impl Fn(&BoxError) -> bool + Send + Sync + 'static) -> Self {
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

/// Why a job failed for good, or why an attempt failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JobFailure {
    /// No handler is registered for the job's kind (never retried).
    #[error("no handler for job kind {kind:?}")]
    UnknownKind {
        /// The kind, as stored.
        kind: String,
    },
    /// The payload does not deserialize into the handler's type (never retried).
    #[error("the payload of a {kind:?} job does not deserialize: {reason}")]
    BadPayload {
        /// The kind.
        kind: String,
        /// serde's message.
        reason: String,
    },
    /// The handler returned an error.
    #[error("the handler failed: {0}")]
    Handler(String),
    /// The handler panicked.
    #[error("the handler panicked: {0}")]
    Panicked(String),
}

/// How one job's attempt ended (committed: the job's row says so too).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum JobOutcome {
    /// The handler succeeded: its writes and the job's completion committed together.
    Completed,
    /// The attempt failed and the job runs again after `after`; its writes were rolled back.
    Retrying {
        /// Why.
        failure: JobFailure,
        /// The delay before the retry is due.
        after: Duration,
    },
    /// The job failed for good (its error is kept in its row); its writes were rolled back.
    Failed(JobFailure),
}

/// One job a worker ran.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobRun {
    /// The job.
    pub id: JobId,
    /// Its kind (invalid UTF-8, which only a foreign writer can store, replaced).
    pub kind: String,
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// How it ended.
    pub outcome: JobOutcome,
}

/// A job's raw fields, for a kind's type-erased runner.
struct Raw<'a> {
    id: JobId,
    attempt: u32,
    key: Option<String>,
    payload: &'a str,
}

/// A kind's runner: deserializes the payload (or says why not) and starts the handler.
type Runner = dyn for<'t> Fn(&'t Tx, Raw<'_>) -> std::result::Result<SectionWork<'t, ()>, String>
    + Send
    + Sync;

/// Makes a closure's future borrow the `Tx` it is given (inference alone does not).
fn runner<F>(run: F) -> F
where
    F: for<'t> Fn(&'t Tx, Raw<'_>) -> std::result::Result<SectionWork<'t, ()>, String>
        + Send
        + Sync,
{
    run
}

struct Kind {
    run: Box<Runner>,
    policy: RetryPolicy,
}

/// The handlers of a worker, by kind. Cheap to clone.
#[derive(Clone, Default)]
pub struct Jobs {
    kinds: HashMap<Vec<u8>, Arc<Kind>>,
}

impl fmt::Debug for Jobs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kinds: Vec<_> = (self.kinds.keys())
            .map(|k| String::from_utf8_lossy(k))
            .collect();
        f.debug_struct("Jobs").field("kinds", &kinds).finish()
    }
}

impl Jobs {
    /// No handlers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs jobs of `kind` with `handler`, retried as `policy` says. The handler gets the job's
    /// transaction (its writes commit with the job's completion, or roll back with a failed
    /// attempt) and the job with its payload deserialized as `P`. Registering a kind again
    /// replaces its handler.
    #[must_use]
    pub fn handle<P, F>(mut self, kind: impl Into<String>, policy: RetryPolicy, handler: F) -> Self
    where
        P: DeserializeOwned + Send + 'static,
        F: for<'t> Fn(&'t Tx, Job<P>) -> SectionWork<'t, ()> + Send + Sync + 'static,
    {
        let run = runner(move |tx, raw| {
            let payload = serde_json::from_str::<P>(raw.payload).map_err(|e| e.to_string())?;
            Ok(handler(
                tx,
                Job {
                    id: raw.id,
                    attempt: raw.attempt,
                    key: raw.key,
                    payload,
                },
            ))
        });
        let runner = Kind {
            run: Box::new(run),
            policy,
        };
        self.kinds
            .insert(kind.into().into_bytes(), Arc::new(runner));
        self
    }
}

/// Runs the jobs of one database with the handlers of a [`Jobs`]. Cheap to clone: run as many
/// workers as jobs should run at once, each on one connection of the session's pool while it
/// runs a job.
#[derive(Clone, Debug)]
pub struct Worker {
    session: Session,
    jobs: Arc<Jobs>,
    batch: u32,
    /// When this worker (or a clone) last swept for stranded queued jobs.
    swept: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
}

/// How often a worker that found nothing to do looks for stranded queued jobs.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The longest a worker with nothing to do waits before it looks again.
const MAX_IDLE: Duration = Duration::from_secs(1);
/// The first wait of a worker that found nothing to do.
const MIN_IDLE: Duration = Duration::from_millis(20);

impl Worker {
    /// A worker that runs `jobs`' kinds on `session`'s database (its cache receives what the
    /// handlers' repositories write, its policy bounds each reply, its `commit_markers` setting
    /// says how a lost `COMMIT` reply is resolved).
    pub fn new(session: Session, jobs: Jobs) -> Self {
        Self {
            session,
            jobs: Arc::new(jobs),
            batch: 1,
            swept: Arc::default(),
        }
    }

    /// Takes up to `jobs` jobs at a time (default 1, at least 1) and commits them together:
    /// one `BEGIN`, one take, one completion and one `COMMIT` for the batch, each job's handler
    /// in a savepoint of its own, so that a failing job rolls back alone. Never two jobs of one
    /// key in a batch. The price: a batch's jobs run one after another in one transaction, so
    /// each job's completion (and its key's next job) waits for the whole batch — keep batches
    /// small for slow jobs or hot keys, large for many short independent ones.
    pub fn with_batch(mut self, jobs: u32) -> Self {
        self.batch = jobs.max(1);
        self
    }

    /// Runs the next due job, if any: `None` when none is due (or every due job's key is busy
    /// with another worker).
    ///
    /// # Errors
    /// [`crate::Error::Database`] when the database fails outside the handler (a transient
    /// failure has already been tried again within the session policy's `write_attempts`);
    /// [`crate::Error::CommitUnknown`] when the commit's reply was lost and could not be
    /// resolved — the job either completed or runs again, never both. A handler's own failure
    /// is not an error here: it is the job's [`JobOutcome`].
    pub async fn run_one(&self) -> Result<Option<JobRun>> {
        Ok(self.run_up_to(1).await?.pop())
    }

    /// Runs the next batch of due jobs (see [`with_batch`](Self::with_batch)) in one
    /// transaction: empty when none is due.
    ///
    /// # Errors
    /// As [`run_one`](Self::run_one), for the batch as a whole (it commits or not as one).
    pub async fn run_batch(&self) -> Result<Vec<JobRun>> {
        self.run_up_to(self.batch).await
    }

    async fn run_up_to(&self, limit: u32) -> Result<Vec<JobRun>> {
        let session = &self.session;
        let engine = Engine {
            db: session.connection(),
            map: session.map(),
            markers: session.commit_markers(),
        };
        let attempts = session.policy().write_attempts;
        let mut retries = Retries::new(JOB_TABLE.to_owned(), attempts, true, None);
        let mut step = JobStep {
            worker: self,
            limit,
            measured: Vec::new(),
        };
        let runs = engine::run(engine, &mut [], &mut retries, JOB_TABLE, false, &mut step).await?;
        if runs.is_empty() && self.sweep_due() {
            // A job queued behind one that finished before its enqueue committed is made
            // ready here (see `store::QUEUED`); a failure is only logged, the next sweep
            // tries again.
            let db = crate::pool::autocommit(session.connection());
            match within(self.reply(), store::sweep(&db)).await {
                Ok(0) => {}
                Ok(readied) => {
                    debug!(readied, "queued jobs whose key was free made ready");
                    return Box::pin(self.run_up_to(limit)).await;
                }
                Err(error) => warn!(%error, "sweeping for queued jobs failed"),
            }
        }
        Ok(runs)
    }

    /// Whether this worker should sweep now (at most once per [`SWEEP_EVERY`]).
    fn sweep_due(&self) -> bool {
        let now = tokio::time::Instant::now();
        let mut swept = self
            .swept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if swept.is_some_and(|at| now.duration_since(at) < SWEEP_EVERY) {
            return false;
        }
        *swept = Some(now);
        true
    }

    /// Runs due jobs (in batches, see [`with_batch`](Self::with_batch)) until none is left (a
    /// retry due later is left): the `testing` way to run a user's handlers inline, e.g.
    /// against in-memory SQLite. Returns the jobs run.
    ///
    /// # Errors
    /// As [`run_one`](Self::run_one), at the first error.
    pub async fn run_until_idle(&self) -> Result<Vec<JobRun>> {
        let mut runs = Vec::new();
        loop {
            let batch = self.run_batch().await?;
            if batch.is_empty() {
                return Ok(runs);
            }
            runs.extend(batch);
        }
    }

    /// Runs jobs until `shutdown` completes, then returns how many ran. A job that is running
    /// when `shutdown` completes is finished first; nothing new is taken after. With nothing
    /// due, the worker looks again after a wait that doubles from 20 ms to 1 s. A database
    /// error is logged and waited out the same way: a worker never stops on its own.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> u64 {
        tokio::pin!(shutdown);
        let mut ran = 0;
        let mut idle = MIN_IDLE;
        loop {
            // Looked at between jobs only: a running job is never cut short.
            tokio::select! {
                biased;
                () = &mut shutdown => return ran,
                () = std::future::ready(()) => {}
            }
            match self.run_batch().await {
                Ok(batch) if !batch.is_empty() => {
                    ran += batch.len() as u64;
                    idle = MIN_IDLE;
                    continue;
                }
                Ok(_) => {}
                Err(error) => warn!(%error, "running a job failed; waiting before the next"),
            }
            tokio::select! {
                biased;
                () = &mut shutdown => return ran,
                () = tokio::time::sleep(idle) => {}
            }
            idle = (idle * 2).min(MAX_IDLE);
        }
    }

    fn reply(&self) -> Duration {
        self.session.policy().reply_deadline()
    }
}

/// One attempt of the engine: take a job, run it, record how it ended.
struct JobStep<'w> {
    worker: &'w Worker,
    /// At most this many jobs per attempt.
    limit: u32,
    measured: Vec<Measured>,
}

type Attempted = (DatabaseTransaction, Worked<Vec<JobRun>>);

fn undone(txn: DatabaseTransaction, operation: &'static str, e: DbErr) -> Attempted {
    let error = database(operation, &JOB_TABLE, e);
    (txn, Worked::Undone(Tried::failed(error)))
}

impl Step for JobStep<'_> {
    type Output = Vec<JobRun>;

    async fn run(&mut self, txn: DatabaseTransaction, _lockings: &mut [Locking]) -> Attempted {
        self.measured.clear();
        let reply = self.worker.reply();
        let taken = match within(reply, store::take(&txn, self.limit)).await {
            Ok(taken) if taken.is_empty() => {
                let worked = Worked::Kept {
                    value: Vec::new(),
                    end: End::RollBack,
                    effects: Vec::new(),
                };
                return (txn, worked);
            }
            Ok(taken) => taken,
            Err(e) => return undone(txn, "taking jobs from", e),
        };
        let mut runs = Vec::with_capacity(taken.len());
        let mut effects = Vec::new();
        let mut completed = Vec::new();
        for taken in &taken {
            let attempt = u32::try_from(taken.attempts).unwrap_or(0).saturating_add(1);
            let kind = String::from_utf8_lossy(&taken.kind).into_owned();
            let span = info_span!("freshlock.job", id = taken.id, kind = %kind, attempt, outcome = tracing::field::Empty);
            let started = tokio::time::Instant::now();
            let ran = self
                .attempt(&txn, taken, attempt, &kind)
                .instrument(span.clone())
                .await;
            let (outcome, changes) = match ran {
                Ok(ran) => ran,
                // The batch's transaction cannot go on: it rolls back as a whole, and the
                // engine runs the attempt again when the failure is transient.
                Err((operation, e)) => return undone(txn, operation, e),
            };
            let stored_attempts = i32::try_from(attempt).unwrap_or(i32::MAX);
            let recorded = match &outcome {
                JobOutcome::Completed => {
                    completed.push(taken.id);
                    Ok(())
                }
                JobOutcome::Retrying { failure, after } => {
                    let error = failure.to_string();
                    store::failed(&txn, taken.id, stored_attempts, &error, Some(*after)).await
                }
                JobOutcome::Failed(failure) => {
                    let error = failure.to_string();
                    store::failed(&txn, taken.id, stored_attempts, &error, None).await
                }
            };
            if let Err(e) = recorded {
                return undone(txn, "recording how a job ended in", e);
            }
            let name = outcome_name(&outcome);
            span.record("outcome", name);
            let waited = Duration::from_millis(u64::try_from(taken.waited).unwrap_or(0));
            self.measured.push(Measured {
                kind: kind.clone(),
                outcome: name,
                waited,
                ran: started.elapsed(),
                ended_on: (!matches!(outcome, JobOutcome::Retrying { .. })).then_some(attempt),
            });
            effects.extend(changes);
            runs.push(JobRun {
                id: taken.id,
                kind,
                attempt,
                outcome,
            });
        }
        // The next job of each key whose job finished here may run once this commits.
        let finished_keys: Vec<Vec<u8>> = (taken.iter().zip(&runs))
            .filter(|(_, run)| !matches!(run.outcome, JobOutcome::Retrying { .. }))
            .filter_map(|(taken, _)| taken.key.as_ref().map(store::hash))
            .collect();
        if let Err(e) = within(reply, store::promote(&txn, finished_keys)).await {
            return undone(txn, "readying the next jobs of", e);
        }
        let evidence = match self.complete(&txn, &completed).await {
            Ok(evidence) => evidence,
            Err((operation, e)) => return undone(txn, operation, e),
        };
        let worked = Worked::Write {
            value: runs,
            evidence,
            fence: Fence::Unchecked,
            effects,
        };
        (txn, worked)
    }

    fn lease_lost(&mut self) -> Vec<JobRun> {
        // A job holds no lease: its row's lock lasts as long as its transaction.
        Vec::new()
    }

    /// The attempt's metrics, once its transaction committed (an attempt run again after a
    /// failed commit is counted once).
    fn ended(&mut self, _lockings: &[Locking], ended: &Result<()>) {
        if ended.is_err() {
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
struct Measured {
    kind: String,
    outcome: &'static str,
    waited: Duration,
    ran: Duration,
    /// The attempt the job ended on (completed or failed for good).
    ended_on: Option<u32>,
}

impl JobStep<'_> {
    /// Marks the `completed` jobs done: the commit's evidence when the statement took it (on
    /// PostgreSQL with `freshlock_incarnation`, by returning the transaction's id: no round
    /// trip of its own), `None` for the engine to take at the commit.
    async fn complete(
        &self,
        txn: &DatabaseTransaction,
        completed: &[JobId],
    ) -> std::result::Result<Option<Evidence>, (&'static str, DbErr)> {
        const OPERATION: &str = "completing jobs in";
        if completed.is_empty() {
            return Ok(None);
        }
        let reply = self.worker.reply();
        let db = self.worker.session.connection();
        let known = if self.worker.session.commit_markers() {
            match crate::pool::incarnation(db, txn).await {
                crate::pool::Incarnation::Known(token) => Some(Some(token)),
                crate::pool::Incarnation::Unseen => Some(None),
                crate::pool::Incarnation::Unsupported => None,
            }
        } else {
            None
        };
        let Some(known) = known else {
            within(reply, store::complete(txn, completed, None))
                .await
                .map_err(|e| (OPERATION, e))?;
            return Ok(None);
        };
        let incarnation = known.is_none();
        let stamps = crate::commit::stamps(incarnation);
        let row = within(reply, store::complete(txn, completed, Some(stamps)))
            .await
            .map_err(|e| (OPERATION, e))?
            .ok_or_else(|| (OPERATION, DbErr::RecordNotFound("a job to complete".into())))?;
        let (xid, seen) = Evidence::read(&row, incarnation).map_err(|e| (OPERATION, e))?;
        within(reply, Evidence::stamped(txn, db, xid, known, seen))
            .await
            .map(Some)
            .map_err(|e| ("marking the commit of", e))
    }

    /// Runs the job's handler in a savepoint of `txn`: how the attempt ended and, when it
    /// succeeded, the cache changes its writes make on commit. `Err` when the database failed
    /// around the handler (the savepoint could not be made or ended).
    async fn attempt(
        &self,
        txn: &DatabaseTransaction,
        taken: &store::Taken,
        attempt: u32,
        kind: &str,
    ) -> std::result::Result<(JobOutcome, Vec<Change>), (&'static str, DbErr)> {
        let Some(handler) = self.worker.jobs.kinds.get(&taken.kind) else {
            let failure = JobFailure::UnknownKind {
                kind: kind.to_owned(),
            };
            warn!(%failure, "job failed");
            return Ok((JobOutcome::Failed(failure), Vec::new()));
        };
        let savepoint = txn
            .begin()
            .await
            .map_err(|e| ("starting the savepoint of", e))?;
        let tx = Tx::new(savepoint, self.worker.session.clone());
        let raw = Raw {
            id: taken.id,
            attempt,
            key: taken
                .key
                .as_ref()
                .map(|k| String::from_utf8_lossy(k).into_owned()),
            payload: &taken.payload,
        };
        let ran = match (handler.run)(&tx, raw) {
            Err(reason) => Err((
                JobFailure::BadPayload {
                    kind: kind.to_owned(),
                    reason,
                },
                None,
            )),
            Ok(work) => match (CatchUnwind { inner: work }).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(error)) => {
                    let error = error.into_inner();
                    let retries = (handler.policy.retry_if.as_ref()).is_none_or(|f| f(&error));
                    Err((JobFailure::Handler(error.to_string()), Some(retries)))
                }
                Err(panic) => Err((JobFailure::Panicked(panic_message(&*panic)), Some(true))),
            },
        };
        let (savepoint, effects, conflicted) = tx.into_parts();
        let ran = match ran {
            Ok(()) if conflicted => Err((
                JobFailure::Handler("a guarded write was refused: the row changed".to_owned()),
                Some(true),
            )),
            ran => ran,
        };
        match ran {
            Ok(()) => {
                savepoint
                    .commit()
                    .await
                    .map_err(|e| ("releasing the savepoint of", e))?;
                debug!("job completed");
                Ok((JobOutcome::Completed, effects))
            }
            Err((failure, retries)) => {
                savepoint
                    .rollback()
                    .await
                    .map_err(|e| ("rolling back the savepoint of", e))?;
                let after = retries
                    .filter(|retries| *retries)
                    .and_then(|_| handler.policy.retry_after(taken.id, attempt));
                warn!(%failure, retry_after = ?after, "job attempt failed");
                Ok(match after {
                    Some(after) => (JobOutcome::Retrying { failure, after }, Vec::new()),
                    None => (JobOutcome::Failed(failure), Vec::new()),
                })
            }
        }
    }
}

fn outcome_name(outcome: &JobOutcome) -> &'static str {
    match outcome {
        JobOutcome::Completed => "completed",
        JobOutcome::Retrying { .. } => "retrying",
        JobOutcome::Failed(_) => "failed",
    }
}

/// A panic's message, when it has one.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(message) = panic.downcast_ref::<&str>() {
        (*message).to_owned()
    } else if let Some(message) = panic.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// A handler's future with its panics caught: a panicking job is a failed attempt, and the
/// worker goes on.
struct CatchUnwind<'t> {
    inner: SectionWork<'t, ()>,
}

impl Future for CatchUnwind<'_> {
    type Output = std::thread::Result<std::result::Result<(), crate::ApplyError>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.get_mut().inner;
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(ready)) => Poll::Ready(Ok(ready)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
