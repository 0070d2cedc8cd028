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
use tokio::sync::Notify;
use tracing::{Instrument, debug, info_span, warn};

use super::{
    JobId,
    lease::{self, Claimed, FinishRunner, Finishing, Lease, Leased, Meta, Output},
    store,
};
use crate::{
    commit::Evidence,
    deadline::within,
    engine::{self, End, Engine, Fence, Retries, Step, Tried, Worked},
    error::{BoxError, Result, database},
    identity_map::Change,
    lock::holder::new_token,
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
    pub(super) retry_if: Option<Arc<RetryIf>>,
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
    /// A leased job's last attempt never finished: its lease expired (its worker stopped, hung
    /// or lost the database), and no attempt is left.
    #[error("the lease of attempt {attempts} (the last) expired before the job finished")]
    LeaseExpired {
        /// The attempts made.
        attempts: u32,
    },
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
    /// A leased job's claim was gone when its work ended: its lease expired and another worker
    /// reclaimed the job, which runs (or ran) again there. This attempt's finish was refused
    /// and rolled back; what its work did outside the database is not undone.
    LeaseLost,
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
pub(super) struct Raw<'a> {
    pub(super) id: JobId,
    pub(super) attempt: u32,
    pub(super) key: Option<String>,
    pub(super) payload: &'a str,
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

/// Makes a closure's future borrow the `Tx` it is given, for a leased kind's finish.
fn finisher<F>(finish: F) -> F
where
    F: for<'t> Fn(&'t Tx, Meta, &Output) -> std::result::Result<SectionWork<'t, ()>, String>
        + Send
        + Sync,
{
    finish
}

/// A kind's handler and retry policy.
pub(super) struct Kind {
    handler: Handler,
    pub(super) policy: RetryPolicy,
}

impl Kind {
    /// The kind's lease and handlers, when it is leased.
    pub(super) fn leased(&self) -> Option<(&Leased, &RetryPolicy)> {
        match &self.handler {
            Handler::Leased(leased) => Some((leased, &self.policy)),
            Handler::InTx(_) => None,
        }
    }
}

/// How a kind runs.
enum Handler {
    /// In the transaction that took the job.
    InTx(Box<Runner>),
    /// Claimed under a lease, worked outside any transaction, finished in a fenced one.
    Leased(Leased),
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
            handler: Handler::InTx(Box::new(run)),
            policy,
        };
        self.kinds
            .insert(kind.into().into_bytes(), Arc::new(runner));
        self
    }

    /// Runs jobs of `kind` in the field report's shape, for work too long to hold a transaction
    /// open: the worker **claims** the job under a `lease` (a short transaction; the job's key
    /// stays busy), runs `work` **outside any transaction** while a heartbeat extends the lease
    /// every third of it, then runs `finish` with `work`'s output in a transaction **fenced by
    /// the claim**: its writes and the job's completion commit together, and only if the claim
    /// still holds. A worker that stops or hangs lets its lease expire; another worker makes
    /// the job wait again and runs it, and the old claim's late finish is refused
    /// ([`JobOutcome::LeaseLost`]). So `finish`'s writes commit once; `work` itself (an HTTP
    /// call) runs at least once per attempt — make it idempotent, or watch
    /// [`Lease::lost`] to stop early.
    ///
    /// Retries follow `policy` as for [`handle`](Self::handle): a failing `work` or `finish`
    /// is a failed attempt. An attempt counts when it is claimed, so a job whose worker dies on
    /// every attempt fails ([`JobFailure::LeaseExpired`]) once its attempts are used. A lease
    /// is at least 300 ms.
    #[must_use]
    pub fn handle_leased<P, R, W, Fut, F>(
        mut self,
        kind: impl Into<String>,
        policy: RetryPolicy,
        lease: Duration,
        work: W,
        finish: F,
    ) -> Self
    where
        P: DeserializeOwned + Send + 'static,
        R: Clone + Send + Sync + 'static,
        W: Fn(Job<P>, Lease) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<R, BoxError>> + Send + 'static,
        F: for<'t> Fn(&'t Tx, Job<R>) -> SectionWork<'t, ()> + Send + Sync + 'static,
    {
        let work = move |raw: Raw<'_>, lease: Lease| {
            let payload = serde_json::from_str::<P>(raw.payload).map_err(|e| e.to_string())?;
            let job = Job {
                id: raw.id,
                attempt: raw.attempt,
                key: raw.key,
                payload,
            };
            let worked = work(job, lease);
            let future: Pin<Box<dyn Future<Output = _> + Send>> =
                Box::pin(async move { worked.await.map(|output| Arc::new(output) as Output) });
            Ok(future)
        };
        let finish = finisher(move |tx, meta, output| {
            // The output was made by this kind's `work`, so it is an `R`.
            let payload = (output.downcast_ref::<R>().cloned())
                .ok_or_else(|| "the work's output is not the finish's type".to_owned())?;
            Ok(finish(
                tx,
                Job {
                    id: meta.id,
                    attempt: meta.attempt,
                    key: meta.key,
                    payload,
                },
            ))
        });
        let leased = Leased {
            lease: lease.max(lease::MIN_LEASE),
            work: Box::new(work),
            finish: Box::new(finish),
        };
        let runner = Kind {
            handler: Handler::Leased(leased),
            policy,
        };
        self.kinds
            .insert(kind.into().into_bytes(), Arc::new(runner));
        self
    }

    fn any_leased(&self) -> bool {
        (self.kinds.values()).any(|kind| kind.leased().is_some())
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
    /// When this worker (or a clone) last reclaimed expired leases.
    reclaimed: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// When this worker (or a clone) last recorded the queue's depth (`metrics` feature).
    gauged: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// The first and the longest wait of [`run`](Self::run) with nothing due.
    poll: (Duration, Duration),
    /// What wakes [`run`](Self::run) when a job is enqueued (PostgreSQL), shared by clones.
    wakeup: Arc<super::wake::Wakeup>,
}

/// How often a worker that found nothing to do looks for stranded queued jobs, and how often a
/// worker with leased kinds reclaims expired leases.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The most jobs of one key a transaction runs one after another (`Source::Take`'s `chain`).
const CHAIN_JOBS: usize = 16;
/// How long a chain may grow: no job of a key is chained into a transaction older than this.
const CHAIN_FOR: Duration = Duration::from_millis(100);

/// How often [`Worker::run`] (one of a worker's clones) records the queue's depth gauge, with
/// the `metrics` feature.
const GAUGE_EVERY: Duration = Duration::from_secs(10);

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
            reclaimed: Arc::default(),
            gauged: Arc::default(),
            poll: (MIN_IDLE, MAX_IDLE),
            wakeup: Arc::default(),
        }
    }

    /// How [`run`](Self::run) waits with nothing due: from `first`, doubling up to `longest`
    /// (default 20 ms to 1 s; `first` is at least 1 ms, `longest` at least `first`). On
    /// PostgreSQL (not behind a transaction pooler) an enqueue wakes a waiting worker at once,
    /// so the wait only bounds how late a job that became due by time (a delay, a retry's
    /// backoff, an expired lease) is taken; elsewhere it is the poll interval.
    pub fn with_poll(mut self, first: Duration, longest: Duration) -> Self {
        let first = first.max(Duration::from_millis(1));
        self.poll = (first, longest.max(first));
        self
    }

    /// Takes up to `jobs` jobs at a time (default 1, at least 1) and commits them together:
    /// one `BEGIN`, one take, one completion and one `COMMIT` for the batch. A failing job rolls
    /// back alone: its failure spoils the transaction, which runs again at once with a savepoint
    /// per handler — the failed job's failure recorded, not its handler run again; the jobs
    /// before it in the batch run again (their writes commit once). Never two jobs of one key
    /// in a batch. The price: a batch's jobs run one after another in one transaction, so
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
        Ok(self.run_up_to(1, &mut None, false).await?.pop())
    }

    /// Runs the next batch of due jobs (see [`with_batch`](Self::with_batch)) in one
    /// transaction: empty when none is due.
    ///
    /// # Errors
    /// As [`run_one`](Self::run_one), for the batch as a whole (it commits or not as one).
    pub async fn run_batch(&self) -> Result<Vec<JobRun>> {
        self.run_up_to(self.batch, &mut None, false).await
    }

    /// Runs up to `limit` due jobs, the next job of key `follow` (a key hash) first when it
    /// is due; `follow` is left as the key whose next job this run readied (one job run, not
    /// leased), for the caller's next run. `chain`: a single job's key may be followed within
    /// the transaction (see `Source::Take`).
    async fn run_up_to(
        &self,
        limit: u32,
        follow: &mut Option<Vec<u8>>,
        chain: bool,
    ) -> Result<Vec<JobRun>> {
        if self.jobs.any_leased() && due(&self.reclaimed) {
            // Leases that expired (their workers stopped or hung) make their jobs wait again; a
            // failure is only logged, the next reclaim tries again.
            let db = self.session.connection();
            match within(self.reply(), store::reclaim(db)).await {
                Ok(0) => {}
                Ok(reclaimed) => warn!(reclaimed, "jobs whose lease expired wait again"),
                Err(error) => warn!(%error, "reclaiming expired job leases failed"),
            }
        }
        let following = follow.take();
        let take = Source::Take {
            limit,
            follow: following.as_deref(),
            chain,
        };
        let Stepped {
            mut runs,
            claimed,
            follow: next,
        } = self.run_step(take).await?;
        *follow = next;
        if !claimed.is_empty() {
            runs.extend(lease::run_all(self, claimed).await?);
            return Ok(runs);
        }
        if runs.is_empty() && due(&self.swept) {
            // A job queued behind one that finished before its enqueue committed is made
            // ready here (see `store::QUEUED`); a failure is only logged, the next sweep
            // tries again.
            let db = self.session.connection();
            match within(self.reply(), store::sweep(db)).await {
                Ok(0) => {}
                Ok(readied) => {
                    debug!(readied, "queued jobs whose key was free made ready");
                    return Box::pin(self.run_up_to(limit, follow, chain)).await;
                }
                Err(error) => warn!(%error, "sweeping for queued jobs failed"),
            }
        }
        Ok(runs)
    }

    /// One attempt of the engine from `source`, run again on a transient failure.
    pub(super) async fn run_step(&self, source: Source<'_>) -> Result<Stepped> {
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
            source,
            measured: Vec::new(),
            claimed: Vec::new(),
            follow: None,
            savepoints: false,
            spoiled: HashMap::new(),
        };
        let runs = engine::run(engine, &mut [], &mut retries, JOB_TABLE, false, &mut step).await?;
        Ok(Stepped {
            runs,
            claimed: step.claimed,
            follow: step.follow,
        })
    }

    pub(super) fn kind(&self, kind: &[u8]) -> Option<Arc<Kind>> {
        self.jobs.kinds.get(kind).cloned()
    }

    /// Whether `kind` is a leased kind here.
    fn is_leased(&self, kind: &[u8]) -> bool {
        self.kind(kind).is_some_and(|k| k.leased().is_some())
    }

    pub(super) fn session(&self) -> &Session {
        &self.session
    }

    /// Runs due jobs (in batches, see [`with_batch`](Self::with_batch)) until none is left (a
    /// retry due later is left): the `testing` way to run a user's handlers inline, e.g.
    /// against in-memory SQLite. Returns the jobs run.
    ///
    /// # Errors
    /// As [`run_one`](Self::run_one), at the first error.
    pub async fn run_until_idle(&self) -> Result<Vec<JobRun>> {
        let mut runs = Vec::new();
        let mut follow = None;
        loop {
            let batch = self.run_up_to(self.batch, &mut follow, true).await?;
            if batch.is_empty() {
                return Ok(runs);
            }
            runs.extend(batch);
        }
    }

    /// Runs jobs until `shutdown` completes, then returns how many ran. A job that is running
    /// when `shutdown` completes is finished first; nothing new is taken after. With nothing
    /// due, the worker waits as [`with_poll`](Self::with_poll) says (20 ms doubling to 1 s) —
    /// on PostgreSQL an enqueue wakes it at once (`LISTEN` on a connection of its own, shared
    /// by the worker's clones; not behind a transaction pooler, where it polls). A database
    /// error is logged and waited out the same way: a worker never stops on its own.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> u64 {
        tokio::pin!(shutdown);
        let wakeup = self.wakeup.notify(self.session.connection()).await;
        let (first, longest) = self.poll;
        let mut ran = 0;
        let mut idle = first;
        let mut follow = None;
        loop {
            // Looked at between jobs only: a running job is never cut short.
            tokio::select! {
                biased;
                () = &mut shutdown => return ran,
                () = std::future::ready(()) => {}
            }
            if cfg!(feature = "metrics") && due_every(&self.gauged, GAUGE_EVERY) {
                let db = self.session.connection();
                match tokio::time::timeout(self.reply(), super::record_depth(db)).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(error)) => warn!(%error, "recording the queue's depth failed"),
                    Err(_) => warn!("recording the queue's depth timed out"),
                }
            }
            // Listening before the take: a job enqueued after it looked wakes the wait below.
            let notified = wakeup.as_deref().map(Notify::notified);
            tokio::pin!(notified);
            if let Some(notified) = notified.as_mut().as_pin_mut() {
                notified.enable();
            }
            match self.run_up_to(self.batch, &mut follow, true).await {
                Ok(batch) if !batch.is_empty() => {
                    ran += batch.len() as u64;
                    idle = first;
                    continue;
                }
                Ok(_) => {}
                Err(error) => warn!(%error, "running a job failed; waiting before the next"),
            }
            let woken = async {
                match notified.as_mut().as_pin_mut() {
                    Some(notified) => notified.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => return ran,
                () = woken => {
                    idle = first;
                    continue;
                }
                () = tokio::time::sleep(idle) => {}
            }
            idle = (idle * 2).min(longest);
        }
    }

    pub(super) fn reply(&self) -> Duration {
        self.session.policy().reply_deadline()
    }
}

/// Whether a worker's periodic chore in `slot` is due (at most once per [`SWEEP_EVERY`]),
/// marking it done now if so.
fn due(slot: &std::sync::Mutex<Option<tokio::time::Instant>>) -> bool {
    due_every(slot, SWEEP_EVERY)
}

/// Whether a worker's periodic chore in `slot` is due (at most once per `every`), marking it
/// done now if so.
fn due_every(slot: &std::sync::Mutex<Option<tokio::time::Instant>>, every: Duration) -> bool {
    let now = tokio::time::Instant::now();
    let mut last = slot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if last.is_some_and(|at| now.duration_since(at) < every) {
        return false;
    }
    *last = Some(now);
    true
}

/// What one attempt of the engine did: the jobs that ended, those the take claimed under a
/// lease (their work is still to run), and the key whose next job it readied (see
/// `Source::Take`'s `follow`).
pub(super) struct Stepped {
    pub(super) runs: Vec<JobRun>,
    pub(super) claimed: Vec<Claimed>,
    follow: Option<Vec<u8>>,
}

/// Where an attempt of the engine gets its jobs.
pub(super) enum Source<'a> {
    /// Takes up to `limit` due jobs: runs those of kinds that run in the transaction, claims
    /// those of leased kinds. With `follow` (a key hash) and a limit of one, the next job of
    /// that key comes first when it is due: a worker follows the key whose job it just
    /// finished, so a hot key's chain never waits for a free worker. With `chain` and a limit
    /// of one, a keyed job that completed is followed by its key's next jobs in the same
    /// transaction (up to [`CHAIN_JOBS`] jobs while the transaction is younger than
    /// [`CHAIN_FOR`]), locked by one statement and completed by the transaction's completion:
    /// a hot key's short jobs share a commit, and send nothing between them, instead of paying
    /// `COMMIT`, `BEGIN` and a take each.
    Take {
        limit: u32,
        follow: Option<&'a [u8]>,
        chain: bool,
    },
    /// Finishes a leased job whose work ended, fenced by its claim.
    Finish(&'a Finishing),
}

/// One attempt of the engine: take jobs (or a leased job to finish), run them, record how they
/// ended.
struct JobStep<'w> {
    worker: &'w Worker,
    source: Source<'w>,
    measured: Vec<Measured>,
    /// The jobs of leased kinds this attempt claimed: their work runs after its commit.
    claimed: Vec<Claimed>,
    /// The key whose next job this attempt readied, for the worker to follow.
    follow: Option<Vec<u8>>,
    /// Whether each handler runs in a savepoint of its own. The first attempt runs them in the
    /// job's transaction itself (no `SAVEPOINT`/`RELEASE` round trips); a handler that fails
    /// there spoils the transaction, which rolls back, and the attempts after it use savepoints.
    savepoints: bool,
    /// Jobs whose handler failed in a transaction that rolled back for it (see `savepoints`),
    /// with the attempt and how it failed: when the next attempt takes the job again at that
    /// attempt, it records the failure instead of running the handler twice.
    spoiled: HashMap<JobId, (u32, JobFailure, Option<bool>)>,
}

type Attempted = (DatabaseTransaction, Worked<Vec<JobRun>>);

/// The database failed doing `.0` (the attempt rolls back and may run again).
type Failed = (&'static str, DbErr);

fn undone(txn: DatabaseTransaction, (operation, e): Failed) -> Attempted {
    let error = database(operation, &JOB_TABLE, e);
    (txn, Worked::Undone(Tried::failed(error)))
}

/// What an attempt did before recording.
enum Did {
    /// Nothing to commit: these runs are reported and the transaction rolls back.
    Nothing(Vec<JobRun>),
    /// These jobs' attempts ended, to record in the transaction (and maybe some were claimed).
    Ended(Vec<Ended>),
    /// A handler that ran without a savepoint failed (see `JobStep::spoiled`): the
    /// transaction rolls back and the attempt runs again.
    Spoiled,
}

/// A job whose attempt ended in this transaction, to record there.
struct Ended {
    id: JobId,
    kind: String,
    key: Option<Vec<u8>>,
    attempt: u32,
    /// Milliseconds since it was due, when it was taken.
    waited: i64,
    outcome: JobOutcome,
    /// The cache changes its writes make on commit.
    effects: Vec<Change>,
    ran: Duration,
    span: Option<tracing::Span>,
}

impl Step for JobStep<'_> {
    type Output = Vec<JobRun>;

    async fn run(&mut self, txn: DatabaseTransaction, _lockings: &mut [Locking]) -> Attempted {
        self.measured.clear();
        self.claimed.clear();
        self.follow = None;
        let (txn, did) = match self.source {
            Source::Take {
                limit,
                follow,
                chain,
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
        match self.record(&txn, ended).await {
            Ok(worked) => (txn, worked),
            Err(failed) => undone(txn, failed),
        }
    }

    fn lease_lost(&mut self) -> Vec<JobRun> {
        // The engine holds no lock for jobs: a job's row lock lasts as long as its transaction,
        // a leased job's claim is checked by the finish itself.
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

/// Where a handler's work in the job's transaction comes from.
enum Start<'a> {
    /// A kind that runs in the transaction.
    InTx(&'a Runner, Raw<'a>),
    /// A leased kind's finish, with its work's output.
    Finish(&'a FinishRunner, Meta, &'a Output),
}

impl JobStep<'_> {
    /// Takes due jobs and runs those of in-transaction kinds; claims those of leased kinds.
    /// Owns the attempt's transaction while it runs (a handler without a savepoint gets it
    /// itself) and hands it back.
    async fn take(
        &mut self,
        mut txn: DatabaseTransaction,
        limit: u32,
        follow: Option<&[u8]>,
        chain: bool,
    ) -> (DatabaseTransaction, std::result::Result<Did, Failed>) {
        let began = tokio::time::Instant::now();
        let reply = self.worker.reply();
        let fail = |e| ("taking jobs from", e);
        // A chain (see `Source::Take`): the key's next jobs, locked at once by one statement
        // when the take saw a job of the key queued behind the one it took — before that one
        // runs, while the connection is warm (a round trip after a job's idle time costs about
        // double), and left queued if that job fails.
        let chains = chain && limit == 1;
        let mut taken = Ok(Vec::new());
        if let Some(key) = follow.filter(|_| limit == 1) {
            taken = within(reply, store::take_key(&txn, key, chains)).await;
        }
        if matches!(&taken, Ok(taken) if taken.is_empty()) {
            taken = within(reply, store::take(&txn, limit, chains)).await;
        }
        let mut taken = match taken {
            Ok(taken) if taken.is_empty() => return (txn, Ok(Did::Nothing(Vec::new()))),
            Ok(taken) => taken,
            Err(e) => return (txn, Err(fail(e))),
        };
        let mut ended = Vec::with_capacity(taken.len());
        let mut ahead = std::collections::VecDeque::new();
        if let [first] = taken.as_slice()
            && first.followed
            && let Some(key) = first.key.as_ref().map(store::hash)
            && !self.worker.is_leased(&first.kind)
        {
            let more = u32::try_from(CHAIN_JOBS - 1).unwrap_or(1);
            ahead = match within(reply, store::take_after(&txn, &key, first.id, more)).await {
                Ok(next) => next.into(),
                Err(e) => return (txn, Err(fail(e))),
            };
        }
        loop {
            let (back, ran) = self
                .run_taken(txn, std::mem::take(&mut taken), &mut ended)
                .await;
            txn = back;
            match ran {
                Ok(None) => {}
                Ok(Some(spoiled)) => return (txn, Ok(spoiled)),
                Err(failed) => return (txn, Err(failed)),
            }
            // The chain goes on while its jobs complete, the transaction is young and no job
            // was claimed.
            let room = ended.len() < CHAIN_JOBS && began.elapsed() < CHAIN_FOR;
            let goes_on =
                matches!(ended.last(), Some(last) if last.outcome == JobOutcome::Completed);
            if !(room && goes_on && self.claimed.is_empty()) {
                break;
            }
            let Some(next) = ahead.pop_front() else {
                break;
            };
            // A leased kind's job is claimed by a take of its own, once the key's promotion
            // made it ready: a chain runs in-transaction kinds only.
            if self.worker.is_leased(&next.kind) {
                break;
            }
            taken = vec![next];
        }
        (txn, Ok(Did::Ended(ended)))
    }

    /// Runs the `taken` jobs of in-transaction kinds in `txn` and claims those of leased kinds,
    /// adding how each ended to `ended`: `Some(Did::Spoiled)` when a handler spoiled `txn`.
    async fn run_taken(
        &mut self,
        txn: DatabaseTransaction,
        taken: Vec<store::Taken>,
        ended: &mut Vec<Ended>,
    ) -> (
        DatabaseTransaction,
        std::result::Result<Option<Did>, Failed>,
    ) {
        let mut txn = txn;
        let reply = self.worker.reply();
        for taken in taken {
            let mut attempt = u32::try_from(taken.attempts).unwrap_or(0).saturating_add(1);
            let kind_name = String::from_utf8_lossy(&taken.kind).into_owned();
            let span = info_span!("freshlock.job", id = taken.id, kind = %kind_name, attempt, outcome = tracing::field::Empty);
            let started = tokio::time::Instant::now();
            let kind = self.worker.kind(&taken.kind);
            let (outcome, effects) = match kind.as_deref() {
                None => {
                    let failure = JobFailure::UnknownKind {
                        kind: kind_name.clone(),
                    };
                    span.in_scope(|| warn!(%failure, "job failed"));
                    (JobOutcome::Failed(failure), Vec::new())
                }
                Some(kind) => match &kind.handler {
                    Handler::Leased(_) if attempt > kind.policy.max_attempts => {
                        // Only an expired lease leaves a job with its attempts used.
                        attempt -= 1;
                        let failure = JobFailure::LeaseExpired { attempts: attempt };
                        span.in_scope(|| warn!(%failure, "job failed"));
                        (JobOutcome::Failed(failure), Vec::new())
                    }
                    Handler::Leased(leased) => {
                        let owner = new_token();
                        let attempts = i32::try_from(attempt).unwrap_or(i32::MAX);
                        let claim = store::claim(&txn, taken.id, attempts, &owner, leased.lease);
                        if let Err(e) = within(reply, claim).await {
                            return (txn, Err(("claiming a job of", e)));
                        }
                        self.claimed.push(Claimed {
                            id: taken.id,
                            kind: taken.kind,
                            key: taken.key,
                            payload: taken.payload,
                            attempt,
                            owner,
                            lease: leased.lease,
                            waited: taken.waited,
                        });
                        continue;
                    }
                    Handler::InTx(run) => {
                        let raw = Raw {
                            id: taken.id,
                            attempt,
                            key: (taken.key.as_ref())
                                .map(|k| String::from_utf8_lossy(k).into_owned()),
                            payload: &taken.payload,
                        };
                        let start = Start::InTx(run, raw);
                        let ran = self.attempt(txn, kind, &kind_name, taken.id, attempt, start);
                        let (back, ran) = ran.instrument(span.clone()).await;
                        txn = back;
                        match ran {
                            Ok(Ran::Ended(outcome, effects)) => (outcome, effects),
                            Ok(Ran::Spoiled) => return (txn, Ok(Some(Did::Spoiled))),
                            Err(failed) => return (txn, Err(failed)),
                        }
                    }
                },
            };
            ended.push(Ended {
                id: taken.id,
                kind: kind_name,
                key: taken.key,
                attempt,
                waited: taken.waited,
                outcome,
                effects,
                ran: started.elapsed(),
                span: Some(span),
            });
        }
        (txn, Ok(None))
    }

    /// Finishes a leased job whose work ended, if its claim still holds: runs its finish (when
    /// the work succeeded) in the transaction. Owns the transaction as [`take`](Self::take).
    async fn finish(
        &mut self,
        txn: DatabaseTransaction,
        finishing: &Finishing,
    ) -> (DatabaseTransaction, std::result::Result<Did, Failed>) {
        let claim = &finishing.claim;
        let kind_name = claim.kind_name();
        let held = within(
            self.worker.reply(),
            store::hold(&txn, claim.id, &claim.owner),
        )
        .await;
        let held = match held {
            Ok(held) => held,
            Err(e) => return (txn, Err(("checking the claim on a job of", e))),
        };
        if !held {
            warn!("the job's lease expired and was taken over: its finish is refused");
            self.measured.push(Measured {
                kind: kind_name.clone(),
                outcome: outcome_name(&JobOutcome::LeaseLost),
                waited: waited(claim.waited),
                ran: finishing.ran,
                ended_on: None,
            });
            let runs = vec![JobRun {
                id: claim.id,
                kind: kind_name,
                attempt: claim.attempt,
                outcome: JobOutcome::LeaseLost,
            }];
            return (txn, Ok(Did::Nothing(runs)));
        }
        let started = tokio::time::Instant::now();
        let kind = self.worker.kind(&claim.kind);
        let leased = kind.as_deref().and_then(Kind::leased);
        let (txn, (outcome, effects)) = match (&finishing.worked, kind.as_deref(), leased) {
            (Ok(output), Some(kind), Some((leased, _))) => {
                let meta = Meta {
                    id: claim.id,
                    attempt: claim.attempt,
                    key: claim.key_text(),
                };
                let start = Start::Finish(&leased.finish, meta, output);
                let (txn, ran) = self
                    .attempt(txn, kind, &kind_name, claim.id, claim.attempt, start)
                    .await;
                match ran {
                    Ok(Ran::Ended(outcome, effects)) => (txn, (outcome, effects)),
                    Ok(Ran::Spoiled) => return (txn, Ok(Did::Spoiled)),
                    Err(failed) => return (txn, Err(failed)),
                }
            }
            (Err((failure, retries)), _, Some((_, policy))) => {
                let outcome = decide(policy, claim.id, claim.attempt, failure.clone(), *retries);
                (txn, (outcome, Vec::new()))
            }
            // The work could not start (its kind is not leased here): fails at once.
            (Err((failure, _)), _, None) => {
                (txn, (JobOutcome::Failed(failure.clone()), Vec::new()))
            }
            (Ok(_), _, _) => {
                let failure = JobFailure::UnknownKind {
                    kind: kind_name.clone(),
                };
                (txn, (JobOutcome::Failed(failure), Vec::new()))
            }
        };
        let ended = Ended {
            id: claim.id,
            kind: kind_name,
            key: claim.key.clone(),
            attempt: claim.attempt,
            waited: claim.waited,
            outcome,
            effects,
            ran: finishing.ran + started.elapsed(),
            span: None,
        };
        (txn, Ok(Did::Ended(vec![ended])))
    }

    /// Records in `txn` how the `ended` jobs' attempts ended, readies the next job of each key
    /// that finished, and marks the completed ones done (with the commit's evidence when that
    /// statement can take it).
    async fn record(
        &mut self,
        txn: &DatabaseTransaction,
        ended: Vec<Ended>,
    ) -> std::result::Result<Worked<Vec<JobRun>>, Failed> {
        let reply = self.worker.reply();
        let mut runs = Vec::with_capacity(ended.len());
        let mut all_effects = Vec::new();
        let mut completed = Vec::new();
        let mut finished_keys = Vec::new();
        for ended in ended {
            let stored_attempts = i32::try_from(ended.attempt).unwrap_or(i32::MAX);
            let recorded = match &ended.outcome {
                JobOutcome::Completed => {
                    completed.push(ended.id);
                    Ok(())
                }
                JobOutcome::Retrying { failure, after } => {
                    let error = failure.to_string();
                    let failed =
                        store::failed(txn, ended.id, stored_attempts, &error, Some(*after));
                    within(reply, failed).await
                }
                JobOutcome::Failed(failure) => {
                    let error = failure.to_string();
                    let failed = store::failed(txn, ended.id, stored_attempts, &error, None);
                    within(reply, failed).await
                }
                // Reported without recording (`Did::Nothing`).
                JobOutcome::LeaseLost => Ok(()),
            };
            recorded.map_err(|e| ("recording how a job ended in", e))?;
            let name = outcome_name(&ended.outcome);
            if let Some(span) = &ended.span {
                span.record("outcome", name);
            }
            let finished = !matches!(ended.outcome, JobOutcome::Retrying { .. });
            if let Some(key) = &ended.key {
                // A key's jobs end here in its order (a chain's, one after another): its next
                // job is readied when the last of them finished, not when it waits for a retry.
                let key = store::hash(key);
                finished_keys.retain(|k| *k != key);
                if finished {
                    finished_keys.push(key);
                }
            }
            self.measured.push(Measured {
                kind: ended.kind.clone(),
                outcome: name,
                waited: waited(ended.waited),
                ran: ended.ran,
                ended_on: finished.then_some(ended.attempt),
            });
            all_effects.extend(ended.effects);
            runs.push(JobRun {
                id: ended.id,
                kind: ended.kind,
                attempt: ended.attempt,
                outcome: ended.outcome,
            });
        }
        // The next job of each key whose job finished here may run once this commits; a
        // worker that ran one job follows its key (see `Source::Take`).
        let single = match (&self.source, finished_keys.as_slice()) {
            (Source::Take { limit: 1, .. }, [key]) => Some(key.clone()),
            _ => None,
        };
        let (evidence, readied) = if completed.is_empty() {
            let readied = within(reply, store::promote(txn, finished_keys, &[]))
                .await
                .map_err(|e| ("readying the next jobs of", e))?;
            (None, readied)
        } else {
            self.complete(txn, &completed, finished_keys).await?
        };
        if single.is_some() {
            self.follow = single.filter(|_| readied == 1);
        }
        Ok(Worked::Write {
            value: runs,
            evidence,
            fence: Fence::Unchecked,
            effects: all_effects,
        })
    }

    /// Marks the `completed` jobs done and readies the next job of each key in `promote` (see
    /// `store::complete`): the commit's evidence when the statement took it (on PostgreSQL with
    /// `freshlock_incarnation`, by returning the transaction's id: no round trip of its own),
    /// `None` for the engine to take at the commit; and how many jobs it readied.
    async fn complete(
        &self,
        txn: &DatabaseTransaction,
        completed: &[JobId],
        promote: Vec<Vec<u8>>,
    ) -> std::result::Result<(Option<Evidence>, u64), Failed> {
        const OPERATION: &str = "completing jobs in";
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
            let (_, readied) = within(reply, store::complete(txn, completed, None, promote))
                .await
                .map_err(|e| (OPERATION, e))?;
            return Ok((None, readied));
        };
        let incarnation = known.is_none();
        let stamps = crate::commit::stamps(incarnation);
        let (row, readied) = within(
            reply,
            store::complete(txn, completed, Some(stamps), promote),
        )
        .await
        .map_err(|e| (OPERATION, e))?;
        let row =
            row.ok_or_else(|| (OPERATION, DbErr::RecordNotFound("a job to complete".into())))?;
        let (xid, seen) = Evidence::read(&row, incarnation).map_err(|e| (OPERATION, e))?;
        within(reply, Evidence::stamped(txn, db, xid, known, seen))
            .await
            .map(|evidence| (Some(evidence), readied))
            .map_err(|e| ("marking the commit of", e))
    }

    /// Runs a handler's work in the job's transaction `txn` — in a savepoint of it once an
    /// attempt was spoiled (see `JobStep::savepoints`), in `txn` itself before — and hands
    /// `txn` back: how the job's attempt ended and, when it succeeded, the cache changes its
    /// writes make on commit; or `Spoiled`, when it failed without a savepoint. `Err` when the
    /// database failed around the handler, or the handler failed on a transient database error
    /// (a deadlock): the engine runs the whole attempt again.
    async fn attempt(
        &mut self,
        txn: DatabaseTransaction,
        kind: &Kind,
        kind_name: &str,
        id: JobId,
        attempt: u32,
        start: Start<'_>,
    ) -> (DatabaseTransaction, std::result::Result<Ran, Failed>) {
        if let Some((at, failure, retries)) = self.spoiled.remove(&id)
            && at == attempt
        {
            // Its handler failed in the transaction rolled back before this one: not run twice.
            let outcome = decide(&kind.policy, id, attempt, failure, retries);
            return (txn, Ok(Ran::Ended(outcome, Vec::new())));
        }
        if !self.savepoints {
            let tx = Tx::new(txn, self.worker.session.clone());
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
        let reply = self.worker.reply();
        let savepoint = match within(reply, txn.begin()).await {
            Ok(savepoint) => savepoint,
            Err(e) => return (txn, Err(("starting the savepoint of", e))),
        };
        let tx = Tx::new(savepoint, self.worker.session.clone());
        let ran = run_handler(&tx, kind, kind_name, start).await;
        let (savepoint, effects, conflicted) = tx.into_parts();
        let ended = match failed(ran, conflicted) {
            None => match within(reply, savepoint.commit()).await {
                Ok(()) => {
                    debug!("job completed");
                    Ok(Ran::Ended(JobOutcome::Completed, effects))
                }
                Err(e) => Err(("releasing the savepoint of", e)),
            },
            // When the database ended the whole transaction (a deadlock on MySQL), the
            // savepoint is gone: the attempt fails with the handler's error, and the engine
            // runs it again if that error is transient.
            Some((failure, retries, handler)) => match within(reply, savepoint.rollback()).await {
                Ok(()) => {
                    let outcome = decide(&kind.policy, id, attempt, failure, retries);
                    Ok(Ran::Ended(outcome, Vec::new()))
                }
                Err(e) => Err(match handler {
                    // A rollback without reply: the connection is silent, which the attempt
                    // must say (nothing more is sent on it).
                    Some(handler) if !crate::deadline::is_no_reply(&e) => {
                        ("running a job's handler in", handler)
                    }
                    _ => ("rolling back the savepoint of", e),
                }),
            },
        };
        (txn, ended)
    }
}

/// How a handler's run ended: `Ok`, or why it failed, whether the failure retries (`None`:
/// never) and the handler's own database error, if it failed with one.
type HandlerRan = std::result::Result<(), (JobFailure, Option<bool>, Option<DbErr>)>;

/// Starts the handler of `start` on `tx` and runs it, its panics caught.
async fn run_handler(tx: &Tx, kind: &Kind, kind_name: &str, start: Start<'_>) -> HandlerRan {
    let started = match start {
        Start::InTx(run, raw) => run(tx, raw),
        Start::Finish(finish, meta, output) => finish(tx, meta, output),
    };
    match started {
        Err(reason) => {
            let kind = kind_name.to_owned();
            Err((JobFailure::BadPayload { kind, reason }, None, None))
        }
        Ok(work) => match (CatchUnwind { inner: work }).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => {
                let error = error.into_inner();
                let retries = (kind.policy.retry_if.as_ref()).is_none_or(|f| f(&error));
                let failure = JobFailure::Handler(error.to_string());
                let handler = error.downcast::<DbErr>().ok().map(|e| *e);
                Err((failure, Some(retries), handler))
            }
            Err(panic) => Err((
                JobFailure::Panicked(panic_message(&*panic)),
                Some(true),
                None,
            )),
        },
    }
}

/// A handler's run with a refused guarded write counted as a failure: `None` when it succeeded.
fn failed(ran: HandlerRan, conflicted: bool) -> Option<(JobFailure, Option<bool>, Option<DbErr>)> {
    match ran {
        Ok(()) if conflicted => Some((
            JobFailure::Handler("a guarded write was refused: the row changed".to_owned()),
            Some(true),
            None,
        )),
        Ok(()) => None,
        Err(failed) => Some(failed),
    }
}

/// Whether a handler's database error is one the engine runs the whole attempt again for (a
/// deadlock, a serialization failure, a lost connection before the commit).
fn transient(error: &DbErr) -> bool {
    crate::db_error::classify(error).is_transient()
}

/// How a handler's run in the job's transaction ended, for `take` and `finish`.
enum Ran {
    /// The job's attempt ended so (its writes, if it succeeded, are in the transaction).
    Ended(JobOutcome, Vec<Change>),
    /// It failed without a savepoint: its writes spoil the transaction (see
    /// `JobStep::spoiled`).
    Spoiled,
}

/// How failed attempt `attempt` of job `id` ends under `policy`: retried later, or failed for
/// good (`retries`: whether the failure retries at all; `None` never does).
fn decide(
    policy: &RetryPolicy,
    id: JobId,
    attempt: u32,
    failure: JobFailure,
    retries: Option<bool>,
) -> JobOutcome {
    let after = retries
        .filter(|retries| *retries)
        .and_then(|_| policy.retry_after(id, attempt));
    warn!(%failure, retry_after = ?after, "job attempt failed");
    match after {
        Some(after) => JobOutcome::Retrying { failure, after },
        None => JobOutcome::Failed(failure),
    }
}

/// A job's wait as stored (milliseconds) as a duration.
fn waited(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

pub(super) fn outcome_name(outcome: &JobOutcome) -> &'static str {
    match outcome {
        JobOutcome::Completed => "completed",
        JobOutcome::Retrying { .. } => "retrying",
        JobOutcome::Failed(_) => "failed",
        JobOutcome::LeaseLost => "lease_lost",
    }
}

/// A panic's message, when it has one.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
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
pub(super) struct CatchUnwind<F> {
    pub(super) inner: F,
}

impl<F: Future + Unpin> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.get_mut().inner;
        match std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(&mut *inner).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(ready)) => Poll::Ready(Ok(ready)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
