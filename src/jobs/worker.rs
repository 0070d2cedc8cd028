//! The worker: runs due jobs one transaction at a time (see `step.rs`), leased jobs' work
//! after their claim (`lease.rs`), and the periodic chores (`chores.rs`) between them.

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::sync::Notify;
use tracing::{Instrument as _, debug, error, warn};

use super::{
    chores::{ADVERTISE_EVERY, GAUGE_EVERY, due, due_every},
    context::Context,
    job::{JobOutcome, JobRun},
    kinds::Jobs,
    lease, periodic,
    run::{Stepped, run_step},
    step::Source,
    store,
};
use crate::{db::deadline::within, error::Result, schema::JOB_TABLE, session::Session};

/// Runs the jobs of one database with the handlers of a [`Jobs`]. Cheap to clone: run as many
/// workers as jobs should run at once, each on one connection of the session's pool while it
/// runs a job.
#[derive(Clone, Debug)]
pub struct Worker {
    cx: Context,
    batch: u32,
    /// When this worker (or a clone) last swept for stranded queued jobs.
    swept: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// When this worker (or a clone) last reclaimed expired leases.
    reclaimed: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// When this worker (or a clone) last recorded the queue's depth (`metrics` feature).
    gauged: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// When this worker (or a clone) last enqueued the periodic kinds' due slots.
    scheduled: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// When this worker (or a clone) last said which kinds it takes.
    advertised: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// The first and the longest wait of [`run`](Self::run) with nothing due.
    poll: (Duration, Duration),
    /// What wakes [`run`](Self::run) when a job is enqueued (PostgreSQL), shared by clones.
    wakeup: Arc<super::wake::Wakeup>,
}

/// The longest a worker with nothing to do waits before it looks again.
const MAX_IDLE: Duration = Duration::from_secs(1);
/// How often a running worker (one of its clones) enqueues the periodic kinds' due slots.
const SCHEDULE_EVERY: Duration = Duration::from_secs(1);
/// The first wait of a worker that found nothing to do.
const MIN_IDLE: Duration = Duration::from_millis(20);

impl Worker {
    /// A worker that runs `jobs`' kinds on `session`'s database (its cache receives what the
    /// handlers' repositories write, its policy bounds each reply, its `commit_markers` setting
    /// says how a lost `COMMIT` reply is resolved).
    pub fn new(session: Session, jobs: Jobs) -> Self {
        Self {
            cx: Context {
                session,
                kinds: jobs.names().into(),
                jobs: Arc::new(jobs),
                limits_ready: Arc::default(),
            },
            batch: 1,
            swept: Arc::default(),
            reclaimed: Arc::default(),
            gauged: Arc::default(),
            scheduled: Arc::default(),
            advertised: Arc::default(),
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

    /// Takes only the jobs of `kinds` (each with a handler in this worker's [`Jobs`]): a named
    /// queue with a concurrency of its own. Workers made from one [`Jobs`] run the kinds of a
    /// queue with as many workers as that queue should run jobs at once — say ten for `email`
    /// and `sms`, two for `report` — so a burst of one queue never takes the workers of another.
    ///
    /// ```
    /// # use freshlock::{ApplyError, Session, Tx, jobs::{Job, Jobs, RetryPolicy, Worker}};
    /// # async fn send(_tx: &Tx, _job: Job<String>) -> Result<(), ApplyError> { Ok(()) }
    /// # fn serve(session: Session) -> freshlock::Result<()> {
    /// let jobs = Jobs::new()
    ///     .handle("email", RetryPolicy::default(), send)
    ///     .handle("sms", RetryPolicy::default(), send)
    ///     .handle("report", RetryPolicy::default(), send);
    /// let messages = Worker::new(session.clone(), jobs.clone()).only(["email", "sms"])?;
    /// let reports = Worker::new(session, jobs).only(["report"])?;
    /// // Spawn `messages.run(…)` ten times (clones) and `reports.run(…)` twice.
    /// # let _ = (messages, reports);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`crate::Error::InvalidJob`] when a kind has no handler in this worker's [`Jobs`].
    pub fn only<K: AsRef<str>>(mut self, kinds: impl IntoIterator<Item = K>) -> Result<Self> {
        let mut only = Vec::new();
        for kind in kinds {
            let kind = kind.as_ref();
            if self.cx.jobs.kind(kind.as_bytes()).is_none() {
                return Err(crate::error::Error::InvalidJob {
                    kind: kind.to_owned(),
                    reason: "this worker has no handler for the kind".to_owned(),
                });
            }
            only.push(kind.as_bytes().to_vec());
        }
        only.sort();
        only.dedup();
        self.cx.kinds = only.into();
        Ok(self)
    }

    /// Takes up to `jobs` jobs at a time (default 1, at least 1) and commits them together:
    /// one `BEGIN`, one take, one completion and one `COMMIT` for the batch. A failing job rolls
    /// back alone: its failure spoils the transaction, which runs again at once with a savepoint
    /// per handler — the failed job's failure recorded, not its handler run again; the jobs
    /// before it in the batch run again (their writes commit once). Never two jobs of one key
    /// in a batch, and its jobs run in one order every worker shares (kind, key, then payload),
    /// so handlers whose writes are named by their job's key or payload lock those rows in one
    /// order and two batches that share rows do not deadlock each other (writes named otherwise
    /// still can: the database then rolls one batch back and it runs again).
    /// The price: a batch's jobs run one after another in one transaction, so
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
    /// is not an error here: it is the job's [`JobOutcome`](super::job::JobOutcome).
    pub async fn run_one(&self) -> Result<Option<JobRun>> {
        Ok(self.run_up_to(1, &mut None, false, None).await?.pop())
    }

    /// Runs the next batch of due jobs (see [`with_batch`](Self::with_batch)) in one
    /// transaction: empty when none is due.
    ///
    /// # Errors
    /// As [`run_one`](Self::run_one), for the batch as a whole (it commits or not as one).
    pub async fn run_batch(&self) -> Result<Vec<JobRun>> {
        self.run_up_to(self.batch, &mut None, false, None).await
    }

    /// Runs up to `limit` due jobs, the next job of key `follow` (a key hash) first when it
    /// is due; `follow` is left as the key whose next job this run readied (one job run, not
    /// leased), for the caller's next run. `chain`: a single job's key may be followed within
    /// the transaction (see `Source::Take`); `stop`: set when the caller's loop was told to
    /// stop (see `Source::Take`).
    async fn run_up_to(
        &self,
        limit: u32,
        follow: &mut Option<Vec<u8>>,
        chain: bool,
        stop: Option<&AtomicBool>,
    ) -> Result<Vec<JobRun>> {
        if self.cx.jobs.any_leased() && due(&self.reclaimed) {
            // Leases that expired (their workers stopped or hung) make their jobs wait again; a
            // failure is only logged, the next reclaim tries again.
            let db = self.cx.session.pool();
            match within(self.cx.reply(), store::reclaim(db)).await {
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
            stop,
        };
        let Stepped {
            mut runs,
            claimed,
            follow: next,
        } = run_step(&self.cx, take).await?;
        *follow = next;
        if !claimed.is_empty() {
            // A single leased job of a key, finished, readied its key's next job: this worker
            // follows the key with it, as after an in-transaction job (a hot key's chain never
            // waits for a worker whose take meets it first).
            let key = match claimed.as_slice() {
                [only] if chain => only.key.as_ref().map(store::hash),
                _ => None,
            };
            let finished = lease::run_all(&self.cx, claimed, chain).await?;
            if finished
                .iter()
                .all(|run| run.outcome == JobOutcome::Completed)
            {
                *follow = key;
            }
            runs.extend(finished);
            return Ok(runs);
        }
        if runs.is_empty() && due(&self.swept) {
            // A job queued behind one that finished before its enqueue committed is made
            // ready here (see `state::Stored::Queued`); a failure is only logged, the next sweep
            // tries again.
            let db = self.cx.session.pool();
            match within(self.cx.reply(), store::sweep(db)).await {
                Ok(0) => {}
                Ok(readied) => {
                    debug!(readied, "queued jobs whose key was free made ready");
                    return Box::pin(self.run_up_to(limit, follow, chain, stop)).await;
                }
                Err(error) => warn!(%error, "sweeping for queued jobs failed"),
            }
        }
        Ok(runs)
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
            let batch = self.run_up_to(self.batch, &mut follow, true, None).await?;
            if batch.is_empty() {
                return Ok(runs);
            }
            runs.extend(batch);
        }
    }

    /// Enqueues the periodic kinds' due slots (see [`super::periodic::Periodic`]); a failure is
    /// only logged, the next pass tries again.
    async fn enqueue_periodic(&self) {
        for periodic in self.cx.jobs.schedules() {
            let db = self.cx.session.pool();
            if let Err(error) = periodic::enqueue_due(db, periodic, self.cx.reply()).await {
                warn!(%error, kind = periodic.kind(), "enqueuing a periodic kind's slots failed");
            }
        }
    }

    /// Runs every job of this worker's kinds that is due now **or within `horizon`** until none
    /// is left, and returns the runs: as if that much time passed, a retry waiting out its
    /// backoff or a job enqueued to run later is made due now (on the database: its due time
    /// is set to now) and runs in the same call. A test controls time with `horizon` instead of
    /// sleeping: `Duration::ZERO` runs only what is due (as
    /// [`run_until_idle`](Self::run_until_idle)), a day runs every retry a policy allows.
    /// Jobs of kinds without a handler here are left as they are.
    ///
    /// ```
    /// # use freshlock::{ApplyError, Session, Tx, jobs::{self, Job, JobOutcome, Jobs, NewJob, RetryPolicy, Worker}};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let db = freshlock::testing::TestDatabase::with_migrator::<migration::Migrator>().await?;
    /// # let db = db.connection().clone();
    /// let flaky = async |_tx: &Tx, job: Job<()>| {
    ///     if job.attempt < 3 {
    ///         return Err(ApplyError::msg("not yet"));
    ///     }
    ///     Ok(())
    /// };
    /// // Retried after up to a minute, then up to two (full jitter).
    /// let policy = RetryPolicy::default().with_backoff(Duration::from_secs(60), Duration::from_secs(3600));
    /// jobs::enqueue(&db, NewJob::new("flaky", &())?).await?;
    /// let worker = Worker::new(Session::new(db.clone()), Jobs::new().handle("flaky", policy, flaky));
    /// let runs = worker.drain(Duration::from_secs(24 * 3600)).await?;
    /// assert_eq!(runs.len(), 3);
    /// assert_eq!(runs[2].outcome, JobOutcome::Completed);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`run_one`](Self::run_one), at the first error.
    pub async fn drain(&self, horizon: Duration) -> Result<Vec<JobRun>> {
        let horizon = i64::try_from(horizon.as_millis()).unwrap_or(i64::MAX / 4);
        let mut runs = Vec::new();
        loop {
            runs.extend(self.run_until_idle().await?);
            let db = self.cx.session.pool();
            let advance = store::advance(db, self.cx.kinds(), horizon);
            let advanced = within(self.cx.reply(), advance)
                .await
                .map_err(|e| crate::error::database("moving due times in", &JOB_TABLE, e))?;
            if advanced == 0 {
                return Ok(runs);
            }
        }
    }

    /// Runs jobs until `shutdown` completes, then returns how many ran. A job that is running
    /// when `shutdown` completes is finished first; nothing new is taken after. With nothing
    /// due, the worker waits as [`with_poll`](Self::with_poll) says (20 ms doubling to 1 s) —
    /// on PostgreSQL an enqueue wakes it at once (`LISTEN` on a connection of its own, shared
    /// by the worker's clones; not behind a transaction pooler, where it polls). A database
    /// error is logged and waited out the same way (a lost connection, a restart, a deadlock:
    /// the worker goes on when the database does).
    ///
    /// A graceful shutdown on `SIGTERM` or Ctrl-C (tokio's `signal` feature), with as many
    /// workers as jobs may run at once:
    ///
    /// ```no_run
    /// # use freshlock::{Session, jobs::{Jobs, Worker}};
    /// # async fn serve(session: Session, handlers: Jobs) -> Result<(), Box<dyn std::error::Error>> {
    /// let (stop, stopped) = tokio::sync::watch::channel(false);
    /// let mut workers = tokio::task::JoinSet::new();
    /// for _ in 0..4 {
    ///     let worker = Worker::new(session.clone(), handlers.clone());
    ///     let mut stopped = stopped.clone();
    ///     workers.spawn(async move {
    ///         worker.run(async move { let _ = stopped.wait_for(|stop| *stop).await; }).await
    ///     });
    /// }
    /// let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    /// tokio::select! {
    ///     _ = term.recv() => {}
    ///     _ = tokio::signal::ctrl_c() => {}
    /// }
    /// // Each worker finishes the job it is running (its commit included) and takes no other.
    /// let _ = stop.send(true);
    /// while let Some(ran) = workers.join_next().await {
    ///     let ran = ran.expect("a worker task panicked")?;
    ///     tracing::info!(ran, "worker stopped");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// A failure it cannot wait out: [`crate::Error::Database`] when the job table does not
    /// exist (freshlock's migrations were not run), so a misdeployed worker stops and says why
    /// instead of logging forever.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<u64> {
        let mut gauge = None;
        let stopped = self.run_loop(shutdown, &mut gauge).await;
        // The depth recorded last is in the gauge when the run returns.
        if let Some(gauge) = gauge {
            let _ = gauge.await;
        }
        stopped
    }

    /// [`run`](Self::run)'s loop; `gauge`: its depth gauge's task, when one was started.
    async fn run_loop(
        &self,
        shutdown: impl Future<Output = ()>,
        gauge: &mut Option<tokio::task::JoinHandle<()>>,
    ) -> Result<u64> {
        tokio::pin!(shutdown);
        let wakeup = self.wakeup.notify(self.cx.session.pool()).await;
        let (first, longest) = self.poll;
        let mut ran = 0;
        let mut idle = first;
        let mut follow = None;
        loop {
            // Looked at between jobs only: a running job is never cut short.
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(ran),
                () = std::future::ready(()) => {}
            }
            // First, before the depth and the first take: a kind shows as handled once its worker runs.
            if due_every(&self.advertised, ADVERTISE_EVERY) {
                let advertised = store::advertise(self.cx.session.pool(), self.cx.kinds());
                match tokio::time::timeout(self.cx.reply(), advertised).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(error)) => warn!(%error, "saying which kinds this worker takes failed"),
                    Err(_) => warn!("saying which kinds this worker takes timed out"),
                }
            }
            if cfg!(feature = "metrics") {
                self.gauge(gauge);
            }
            if due_every(&self.scheduled, SCHEDULE_EVERY) {
                self.enqueue_periodic().await;
            }
            // Listening before the take: a job enqueued after it looked wakes the wait below.
            let notified = wakeup.as_deref().map(Notify::notified);
            tokio::pin!(notified);
            if let Some(notified) = notified.as_mut().as_pin_mut() {
                notified.enable();
            }
            // Told to stop while the step runs: it finishes the jobs it took and takes no other.
            let stop = AtomicBool::new(false);
            let step = self.run_up_to(self.batch, &mut follow, true, Some(&stop));
            tokio::pin!(step);
            let stepped = loop {
                tokio::select! {
                    biased;
                    stepped = &mut step => break stepped,
                    () = &mut shutdown, if !stop.load(Ordering::SeqCst) => {
                        stop.store(true, Ordering::SeqCst);
                    }
                }
            };
            // `shutdown` completed (it is not polled again).
            if stop.load(Ordering::SeqCst) {
                return match stepped {
                    Ok(batch) => Ok(ran + batch.len() as u64),
                    Err(error) if error.is_missing_table() => {
                        error!(%error, "the job table is missing: the worker stops");
                        Err(error)
                    }
                    Err(error) => {
                        warn!(%error, "running a job failed as the worker stopped");
                        Ok(ran)
                    }
                };
            }
            match stepped {
                Ok(batch) if !batch.is_empty() => {
                    ran += batch.len() as u64;
                    idle = first;
                    continue;
                }
                Ok(_) => {}
                Err(error) if error.is_missing_table() => {
                    error!(%error, "the job table is missing: the worker stops");
                    return Err(error);
                }
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
                () = &mut shutdown => return Ok(ran),
                () = woken => {
                    idle = first;
                    continue;
                }
                () = tokio::time::sleep(idle) => {}
            }
            idle = (idle * 2).min(longest);
        }
    }

    /// Records the queue's depth (by kind, [`super::query::record_kind_depth`]) when it is due,
    /// in `task`, a task of its own: its `GROUP BY` reads every unfinished job, and the loop
    /// takes on meanwhile. One at a time per loop; the clones of a worker share when it is due.
    fn gauge(&self, task: &mut Option<tokio::task::JoinHandle<()>>) {
        let running = task.as_ref().is_some_and(|task| !task.is_finished());
        if running || !due_every(&self.gauged, GAUGE_EVERY) {
            return;
        }
        let (db, reply) = (self.cx.session.pool().clone(), self.cx.reply());
        let recorded = async move {
            match tokio::time::timeout(reply, super::query::record_kind_depth(&db)).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => warn!(%error, "recording the queue's depth failed"),
                Err(_) => warn!("recording the queue's depth timed out"),
            }
        };
        *task = Some(tokio::spawn(recorded.in_current_span()));
    }
}
