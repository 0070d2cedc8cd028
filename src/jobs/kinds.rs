//! The handlers of a worker, by kind ([`Jobs`]): how each kind runs — in the job's
//! transaction, or leased — type-erased behind a runner.

use std::{collections::HashMap, fmt, future::Future, pin::Pin, sync::Arc, time::Duration};

use serde::de::DeserializeOwned;

use super::{
    Job, RetryPolicy,
    job::Raw,
    leased::{self, Lease, Leased, Meta, Output},
};
use crate::{error::BoxError, tx::Tx, write::section::SectionWork};

/// A kind's runner: deserializes the payload (or says why not) and starts the handler.
pub(super) type Runner = dyn for<'t> Fn(&'t Tx, Raw<'_>) -> std::result::Result<SectionWork<'t, ()>, String>
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
    pub(super) handler: Handler,
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
pub(super) enum Handler {
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
    /// ([`JobOutcome::LeaseLost`](super::JobOutcome::LeaseLost)). So `finish`'s writes commit once; `work` itself (an HTTP
    /// call) runs at least once per attempt — make it idempotent, or watch
    /// [`Lease::lost`] to stop early.
    ///
    /// Retries follow `policy` as for [`handle`](Self::handle): a failing `work` or `finish`
    /// is a failed attempt. An attempt counts when it is claimed, so a job whose worker dies on
    /// every attempt fails ([`JobFailure::LeaseExpired`](super::JobFailure::LeaseExpired)) once its attempts are used. A lease
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
            lease: lease.max(leased::MIN_LEASE),
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

    /// The handler of `kind`, if there is one.
    pub(super) fn kind(&self, kind: &[u8]) -> Option<Arc<Kind>> {
        self.kinds.get(kind).cloned()
    }

    /// Whether any kind is leased (then a worker reclaims expired leases).
    pub(super) fn any_leased(&self) -> bool {
        (self.kinds.values()).any(|kind| kind.leased().is_some())
    }
}
