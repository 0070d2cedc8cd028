//! What a handler is: an `async fn`, an async closure, or a type of your own that implements
//! [`Handler`] (or [`Finish`], for a leased kind's finish) — no boxing.
//!
//! Rust cannot yet say "an async closure whose future is `Send`" (naming `AsyncFn`'s future is
//! unstable), so the bounds here are `Fn`s returning a future that may borrow the arguments
//! ([`HandlerFn`], [`FinishFn`]). They hold for `async fn` items and for async closures that
//! capture nothing; a handler that needs state (an HTTP client, settings) is a value of a type
//! that implements [`Handler`], its state in its fields, or a closure that clones its state into
//! a boxed future, passed through [`handler`].

use std::future::Future;

use super::job::Job;
use crate::{error::ApplyError, tx::Tx, write::section::SectionWork};

/// A kind's handler, run in the job's transaction ([`Jobs::handle`](super::Jobs::handle)).
///
/// Implemented by every `async fn(&Tx, Job<P>) -> Result<(), ApplyError>` and every async
/// closure of that shape that captures nothing; implement it for a type of your own when the
/// handler needs state:
///
/// ```
/// use std::sync::Arc;
/// use freshlock::{ApplyError, Tx, jobs::{Handler, Job, Jobs, RetryPolicy}};
///
/// struct Notify {
///     sent: Arc<std::sync::atomic::AtomicU64>,
/// }
///
/// impl Handler<String> for Notify {
///     async fn run(&self, _tx: &Tx, job: Job<String>) -> Result<(), ApplyError> {
///         tracing::info!(to = %job.payload, "notified");
///         self.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
///         Ok(())
///     }
/// }
///
/// let sent = Arc::default();
/// let jobs = Jobs::new().handle("notify", RetryPolicy::default(), Notify { sent });
/// # let _ = jobs;
/// ```
pub trait Handler<P>: Send + Sync + 'static {
    /// Runs `job` in the job's transaction `tx`: its writes commit with the job's completion,
    /// or roll back with a failed attempt.
    fn run(&self, tx: &Tx, job: Job<P>) -> impl Future<Output = Result<(), ApplyError>> + Send;
}

/// A function or closure that is a [`Handler`]: `Fn(&'t Tx, Job<P>)` returning a `Send`
/// future that may borrow the transaction. Implemented for every such function; not meant to be
/// implemented by hand.
pub trait HandlerFn<'t, P>: Fn(&'t Tx, Job<P>) -> Self::Future {
    /// The future the function returns.
    type Future: Future<Output = Result<(), ApplyError>> + Send + 't;
}

impl<'t, P, F, Fut> HandlerFn<'t, P> for F
where
    F: Fn(&'t Tx, Job<P>) -> Fut,
    Fut: Future<Output = Result<(), ApplyError>> + Send + 't,
{
    type Future = Fut;
}

impl<P, F> Handler<P> for F
where
    F: for<'t> HandlerFn<'t, P> + Send + Sync + 'static,
{
    fn run(&self, tx: &Tx, job: Job<P>) -> impl Future<Output = Result<(), ApplyError>> + Send {
        self(tx, job)
    }
}

/// A leased kind's finish ([`Jobs::handle_leased`](super::Jobs::handle_leased)): given the job
/// (its payload as enqueued) and what its work returned, it writes in a transaction fenced by
/// the job's claim.
///
/// Implemented by every `async fn(&Tx, Job<P>, &R) -> Result<(), ApplyError>` and every async
/// closure of that shape that captures nothing; implement it for a type of your own when the
/// finish needs state. The output is lent, not given: a finish that meets a deadlock runs again
/// with the same output, so `R` need not be `Clone`.
pub trait Finish<P, R>: Send + Sync + 'static {
    /// Writes what `job`'s work returned (`output`) in the fenced transaction `tx`.
    fn finish<'t>(
        &'t self,
        tx: &'t Tx,
        job: Job<P>,
        output: &'t R,
    ) -> impl Future<Output = Result<(), ApplyError>> + Send + 't;
}

/// A function or closure that is a [`Finish`]: `Fn(&'t Tx, Job<P>, &'t R)` returning a `Send`
/// future that may borrow the transaction and the output. Implemented for every such function;
/// not meant to be implemented by hand.
pub trait FinishFn<'t, P, R: 't>: Fn(&'t Tx, Job<P>, &'t R) -> Self::Future {
    /// The future the function returns.
    type Future: Future<Output = Result<(), ApplyError>> + Send + 't;
}

impl<'t, P, R: 't, F, Fut> FinishFn<'t, P, R> for F
where
    F: Fn(&'t Tx, Job<P>, &'t R) -> Fut,
    Fut: Future<Output = Result<(), ApplyError>> + Send + 't,
{
    type Future = Fut;
}

impl<P, R, F> Finish<P, R> for F
where
    F: for<'t> FinishFn<'t, P, R> + Send + Sync + 'static,
{
    fn finish<'t>(
        &'t self,
        tx: &'t Tx,
        job: Job<P>,
        output: &'t R,
    ) -> impl Future<Output = Result<(), ApplyError>> + Send + 't {
        self(tx, job, output)
    }
}

/// Makes a closure that captures state a [`Handler`]: the closure clones what it needs into a
/// boxed future (`Box::pin(async move { … })`) that may borrow the transaction. Rust infers
/// that the future borrows the `Tx` only where the closure is passed to a function that says
/// so; this is that function, as [`section_work`](crate::section_work) is for sections.
///
/// ```
/// use std::sync::{Arc, atomic::{AtomicU64, Ordering}};
/// use freshlock::jobs::{self, Job, Jobs, RetryPolicy};
///
/// let sent = Arc::new(AtomicU64::new(0));
/// let counted = Arc::clone(&sent);
/// let notify = jobs::handler(move |_tx, job: Job<String>| {
///     let counted = Arc::clone(&counted);
///     Box::pin(async move {
///         tracing::info!(to = %job.payload, "notified");
///         counted.fetch_add(1, Ordering::Relaxed);
///         Ok(())
///     })
/// });
/// let jobs = Jobs::new().handle("notify", RetryPolicy::default(), notify);
/// # let _ = jobs;
/// ```
pub fn handler<P, F>(handler: F) -> BoxedHandler<F>
where
    F: for<'t> Fn(&'t Tx, Job<P>) -> SectionWork<'t, ()> + Send + Sync + 'static,
{
    BoxedHandler(handler)
}

/// A closure returning a boxed future, as a [`Handler`]: made by [`handler`].
#[derive(Clone, Copy, Debug)]
pub struct BoxedHandler<F>(F);

impl<P, F> Handler<P> for BoxedHandler<F>
where
    F: for<'t> Fn(&'t Tx, Job<P>) -> SectionWork<'t, ()> + Send + Sync + 'static,
{
    fn run(&self, tx: &Tx, job: Job<P>) -> impl Future<Output = Result<(), ApplyError>> + Send {
        (self.0)(tx, job)
    }
}
