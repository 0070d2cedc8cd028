//! The handlers of a worker, by kind ([`Jobs`]): how each kind runs — in the job's
//! transaction, or leased — type-erased behind a runner.

use std::{
    collections::HashMap, fmt, future::Future, marker::PhantomData, pin::Pin, sync::Arc,
    time::Duration,
};

use serde::de::DeserializeOwned;

use super::{
    handler::{Finish, Handler},
    job::{Job, Raw},
    leased::{self, Lease, Leased, Output},
    limit::Limit,
    periodic::Periodic,
    retry::RetryPolicy,
};
use crate::{error::ApplyError, tx::Tx, write::section::SectionWork};

/// A kind's runner: deserializes the payload (or says why not) and starts the handler.
pub(super) type Runner = dyn for<'t> Fn(&'t Tx, Raw<'_>) -> std::result::Result<SectionWork<'t, ()>, String>
    + Send
    + Sync;

/// A kind's handler and retry policy.
pub(super) struct Kind {
    pub(super) handler: Runs,
    pub(super) policy: RetryPolicy,
}

impl Kind {
    /// The kind's lease and handlers, when it is leased.
    pub(super) fn leased(&self) -> Option<(&Leased, &RetryPolicy)> {
        match &self.handler {
            Runs::Leased(leased) => Some((leased, &self.policy)),
            Runs::InTx(_) => None,
        }
    }
}

/// How a kind runs.
pub(super) enum Runs {
    /// In the transaction that took the job.
    InTx(Box<Runner>),
    /// Claimed under a lease, worked outside any transaction, finished in a fenced one.
    Leased(Leased),
}

/// The handlers of a worker, by kind. Cheap to clone.
#[derive(Clone, Default)]
pub struct Jobs {
    kinds: HashMap<Vec<u8>, Arc<Kind>>,
    /// The kinds' names, sorted: what a worker's take asks for.
    names: Vec<Vec<u8>>,
    /// The periodic kinds' schedules.
    periodic: Vec<Periodic>,
    /// The kinds' limits.
    limits: HashMap<Vec<u8>, Vec<Limit>>,
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
    ///
    /// A handler is an `async fn`, an async closure that captures nothing, or a value of a type
    /// that implements [`Handler`] (for state); its error is an [`ApplyError`], which `?` makes
    /// from any error (a `DbErr`, a [`crate::Error`], your own):
    ///
    /// ```
    /// use freshlock::{ApplyError, Tx, jobs::{Job, Jobs, RetryPolicy}};
    /// use sea_orm::ConnectionTrait;
    ///
    /// async fn touch(tx: &Tx, job: Job<i64>) -> Result<(), ApplyError> {
    ///     tx.execute_unprepared(&format!("UPDATE ham SET n = n + 1 WHERE id = {}", job.payload))
    ///         .await?;
    ///     Ok(())
    /// }
    ///
    /// let log = async |_tx: &Tx, job: Job<String>| -> Result<(), ApplyError> {
    ///     tracing::info!(line = %job.payload, "logged");
    ///     Ok(())
    /// };
    /// let jobs = Jobs::new()
    ///     .handle("touch", RetryPolicy::default(), touch)
    ///     .handle("log", RetryPolicy::default(), log);
    /// # let _ = jobs;
    /// ```
    ///
    /// A job key is not a row lock: jobs of one key run one at a time, but a handler that
    /// writes rows other code writes too still locks them (`locked_update`, a section's
    /// [`ForUpdate`](crate::ForUpdate) reads).
    #[must_use]
    pub fn handle<P, H>(mut self, kind: impl Into<String>, policy: RetryPolicy, handler: H) -> Self
    where
        P: DeserializeOwned + Send + 'static,
        H: Handler<P>,
    {
        let handler = Arc::new(handler);
        let run: Box<Runner> = Box::new(move |tx: &Tx, raw: Raw<'_>| {
            let job = raw.job::<P>()?;
            let handler = Arc::clone(&handler);
            let work: SectionWork<'_, ()> = Box::pin(async move { handler.run(tx, job).await });
            Ok(work)
        });
        self.insert(kind.into(), Runs::InTx(run), policy);
        self
    }

    /// Runs jobs of `kind` in the field report's shape, for work too long to hold a transaction
    /// open: the worker **claims** the job under a `lease` (a short transaction; the job's key
    /// stays busy), runs `work` **outside any transaction** while a heartbeat extends the lease
    /// every third of it, then runs `finish` with the job (its payload as enqueued) and `work`'s
    /// output in a transaction **fenced by the claim**: its writes and the job's completion
    /// commit together, and only if the claim still holds. A worker that stops or hangs lets
    /// its lease expire; another worker makes the job wait again and runs it, and the old
    /// claim's late finish is refused
    /// ([`JobOutcome::LeaseLost`](super::JobOutcome::LeaseLost)). So `finish`'s writes commit
    /// once; `work` itself (an HTTP call) runs at least once per attempt — make it idempotent,
    /// or watch [`Lease::lost`] to stop early.
    ///
    /// `work` is any function or closure returning a future (it owns what it is given, so a
    /// closure may clone its state into an `async move` block); `finish` is a [`Finish`], as a
    /// handler is a [`Handler`]. Both fail with an [`ApplyError`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use freshlock::{ApplyError, Tx, jobs::{Job, Jobs, Lease, RetryPolicy}};
    ///
    /// async fn render(job: Job<String>, _lease: Lease) -> Result<usize, ApplyError> {
    ///     Ok(job.payload.len()) // minutes of work, no transaction open
    /// }
    ///
    /// async fn store(_tx: &Tx, job: Job<String>, length: &usize) -> Result<(), ApplyError> {
    ///     tracing::info!(page = %job.payload, length, "rendered");
    ///     Ok(())
    /// }
    ///
    /// let jobs = Jobs::new().handle_leased(
    ///     "render",
    ///     RetryPolicy::default(),
    ///     Duration::from_secs(60),
    ///     render,
    ///     store,
    /// );
    /// # let _ = jobs;
    /// ```
    ///
    /// Retries follow `policy` as for [`handle`](Self::handle): a failing `work` or `finish`
    /// is a failed attempt. An attempt counts when it is claimed, so a job whose worker dies on
    /// every attempt fails ([`JobFailure::LeaseExpired`](super::JobFailure::LeaseExpired)) once
    /// its attempts are used. A lease is at least 300 ms.
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
        R: Send + Sync + 'static,
        W: Fn(Job<P>, Lease) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<R, ApplyError>> + Send + 'static,
        F: Finish<P, R>,
    {
        let finish = Arc::new(finish);
        let work = move |raw: Raw<'_>, lease: Lease| {
            let worked = work(raw.job::<P>()?, lease);
            let finish = Arc::clone(&finish);
            let future: Pin<Box<dyn Future<Output = _> + Send>> = Box::pin(async move {
                let output = worked.await?;
                let done = WorkDone {
                    output,
                    finish,
                    payload: PhantomData::<fn() -> P>,
                };
                Ok(Arc::new(done) as Output)
            });
            Ok(future)
        };
        let leased = Leased {
            lease: lease.max(leased::MIN_LEASE),
            work: Box::new(work),
        };
        self.insert(kind.into(), Runs::Leased(leased), policy);
        self
    }

    /// Enqueues `periodic`'s kind on its schedule, each slot once across every worker that
    /// has it ([`Periodic`]); its kind still needs a handler ([`handle`](Self::handle) or
    /// [`handle_leased`](Self::handle_leased)). A schedule for a kind that had one replaces it.
    #[must_use]
    pub fn periodic(mut self, periodic: Periodic) -> Self {
        self.periodic.retain(|p| p.kind() != periodic.kind());
        self.periodic.push(periodic);
        self
    }

    /// Limits the jobs of `kind` across every worker ([`Limit`]): a job over the limit stays
    /// waiting while the worker takes others. A kind has one limit of each sort (running, rate,
    /// rate per key): a second of the same sort replaces the first. A limit may be set before
    /// or after the kind's handler.
    #[must_use]
    pub fn limit(mut self, kind: impl Into<String>, limit: Limit) -> Self {
        let limits = self.limits.entry(kind.into().into_bytes()).or_default();
        limits.retain(|l| !l.same_sort(&limit));
        limits.push(limit);
        self
    }

    /// The limits of `kind`.
    pub(super) fn limits(&self, kind: &[u8]) -> &[Limit] {
        self.limits.get(kind).map_or(&[], Vec::as_slice)
    }

    /// The periodic kinds' schedules.
    pub(super) fn schedules(&self) -> &[Periodic] {
        &self.periodic
    }

    /// Registers `kind`'s handler, replacing one it had.
    fn insert(&mut self, kind: String, handler: Runs, policy: RetryPolicy) {
        let kind = kind.into_bytes();
        if let Err(at) = self.names.binary_search(&kind) {
            self.names.insert(at, kind.clone());
        }
        self.kinds.insert(kind, Arc::new(Kind { handler, policy }));
    }

    /// The kinds there are handlers for, sorted: a worker takes only these.
    pub(super) fn names(&self) -> &[Vec<u8>] {
        &self.names
    }

    /// The handler of `kind`, if there is one.
    pub(super) fn kind(&self, kind: &[u8]) -> Option<Arc<Kind>> {
        self.kinds.get(kind).cloned()
    }

    /// Whether any kind is leased (then a worker reclaims expired leases).
    pub(super) fn any_leased(&self) -> bool {
        (self.kinds.values()).any(|kind| kind.leased().is_some())
    }
}

/// A leased job's work's output with its kind's finish ([`leased::Finishable`]).
struct WorkDone<P, R, F> {
    output: R,
    finish: Arc<F>,
    payload: PhantomData<fn() -> P>,
}

impl<P, R, F> leased::Finishable for WorkDone<P, R, F>
where
    P: DeserializeOwned + Send + 'static,
    R: Send + Sync + 'static,
    F: Finish<P, R>,
{
    fn finish<'t>(
        &'t self,
        tx: &'t Tx,
        raw: Raw<'_>,
    ) -> std::result::Result<SectionWork<'t, ()>, String> {
        let job = raw.job::<P>()?;
        Ok(Box::pin(self.finish.finish(tx, job, &self.output)))
    }
}
