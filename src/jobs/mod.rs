//! Keyed jobs: a job queue in the application's own database, on the same engine as locked
//! writes — the Django field report's Celery tasks, with its "twice" guard and its skew built in.
//!
//! - **Enqueue inside your transaction** ([`enqueue`]): on a section's [`Tx`](crate::Tx), its
//!   [`Tx::transaction`](crate::Tx::transaction), any sea-orm transaction or a plain connection.
//!   A job whose transaction rolls back never exists; one whose transaction commits is never
//!   lost.
//! - **Per-key order, no waiting workers.** Jobs that share a serialization key
//!   ([`NewJob::key`]) run one at a time, in enqueue order. A worker takes the first due job
//!   whose key has no earlier unfinished job, with `FOR UPDATE SKIP LOCKED`: the job of a busy
//!   key is locked by the worker running it, so other workers skip the whole key and take
//!   another key's job. A hot key occupies one worker; the rest drain at full speed. (SQLite
//!   has one writer: there the running job's `BEGIN IMMEDIATE` transaction is the exclusion.)
//!   A job waiting for its retry keeps its key's place, so order holds through retries.
//! - **Exactly-once effects.** A handler runs inside the transaction that locked its job's row
//!   and is given it as a [`Tx`](crate::Tx) (its repositories' reads and guarded saves, plain
//!   sea-orm queries, all in that transaction); the job is marked done in that same transaction,
//!   which the engine commits with the evidence of locked writes. A crash before the commit
//!   rolls both back and the job runs again as soon as the database has seen its connection go
//!   (no lease to wait out); a lost `COMMIT` reply is resolved from the evidence, never run
//!   twice. What a handler does outside the database — an HTTP call — stays at-least-once.
//! - **Long work outside the database** ([`Jobs::handle_leased`]): claim under a lease, work
//!   outside any transaction with a heartbeat, finish in a transaction fenced by the claim (a
//!   late finish after a takeover is refused: [`JobOutcome::LeaseLost`]). See `lease.rs`.
//! - **Retries as Celery users know them** ([`RetryPolicy`], per kind): attempts, exponential
//!   backoff with full jitter, which errors retry. The handler's writes of a failed attempt are
//!   rolled back; the failure is recorded in the job's transaction. After the last attempt the
//!   job is failed, its error kept. A handler that fails on a transient database error (a
//!   deadlock, a lost connection) is not a failed attempt: the engine runs the job's whole
//!   transaction again, within the session policy's `write_attempts`.
//! - **No savepoint unless a job fails.** A handler runs in the job's transaction itself (no
//!   `SAVEPOINT`/`RELEASE` round trips: a job sends `BEGIN`, the take, the completion and
//!   `COMMIT`, keyed or not, on PostgreSQL). When a handler fails there, its writes spoil the
//!   transaction: it rolls back and runs again at once with a savepoint per handler, the failed
//!   job's failure recorded rather than its handler run a second time. So a failing job costs
//!   its batch one more transaction, and the batch's jobs before it run again (their writes
//!   still commit once).
//! - **A worker takes only its kinds.** A worker takes the jobs of the kinds it has handlers
//!   for ([`Jobs`]), so several services, and the old and new versions of one during a rolling
//!   deploy, share one table: a kind no running worker knows waits (and so do the jobs of its
//!   key behind it) until one that knows it starts.
//! - **Bad input never stops a worker.** A payload that does not deserialize fails the job at
//!   once ([`JobFailure`]); a handler that errors or panics is a failed attempt. The worker goes
//!   on with the next job.
//! - **Periodic jobs** ([`Periodic`], [`Jobs::periodic`]): a kind on a cron schedule, each
//!   slot enqueued once across every worker and process (its slot row moved forward in the
//!   enqueue's transaction), restarts included.
//! - **Unique jobs** ([`NewJob::unique`]): enqueuing while a job with the same unique key has
//!   not finished adds nothing and reports [`Enqueued::Duplicate`].
//! - **Batches** ([`Worker::with_batch`]): up to N jobs of distinct keys share a transaction and
//!   its commit; a failing job rolls back alone (see above).
//! - **Chains** ([`Worker::run`], [`Worker::run_until_idle`], one job at a time): when a keyed
//!   job it takes has jobs of its key queued behind it, the worker locks the key's next queued,
//!   due jobs too (one statement) and runs them after it in the same transaction — up to 16
//!   jobs while the transaction is younger than 100 ms — then completes them all with one
//!   statement: a hot key's short jobs share a commit and send nothing between them (each
//!   one's writes still commit with its completion, in order). A chain ends at a job that fails
//!   (the jobs behind it wait for its retry) and before a job of a leased kind. A long job is
//!   never chained into, and `run_one`/`run_batch` never chain.
//! - **Wakeups** (PostgreSQL): an enqueue notifies idle workers when its transaction commits
//!   (`LISTEN`/`NOTIFY`); elsewhere, and behind a transaction pooler, they poll
//!   ([`Worker::with_poll`]).
//! - **Operators** ([`depth`], [`list`], [`retry`], [`discard`], [`cancel`], [`prune`]; the
//!   CLI's `freshlock jobs`).
//!
//! Kinds, keys and unique keys are arbitrary strings (quotes, NUL, emoji, 10 kB), stored whole
//! as bytes; keys and unique keys are matched through their SHA-256 (a collision is
//! 2⁻¹²⁸-unlikely), the same on every database (see [`crate::schema::JobMigration`]).
//!
//! A job key is not a row lock: the jobs of one key run one at a time, but a handler that
//! writes rows other code writes too still locks them (`locked_update`, a section's
//! [`ForUpdate`](crate::ForUpdate) reads).

mod admin;
mod admit;
mod attempt;
mod cancel;
mod catch;
mod chores;
mod context;
mod deferred;
mod enqueue;
mod finish;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod flights;
mod handler;
mod job;
mod kinds;
mod lease;
mod leased;
mod limit;
mod periodic;
mod query;
mod record;
mod retry;
mod run;
mod state;
mod step;
mod store;
mod take;
mod wake;
mod worker;

pub use admin::{Prune, Retried, discard, prune, retry};
pub use cancel::{Cancel, cancel};
pub use enqueue::{Enqueued, EnqueuedMany, NewJob, enqueue, enqueue_many};
pub use handler::{BoxedHandler, Finish, FinishFn, Handler, HandlerFn, handler};
pub use job::{Job, JobFailure, JobId, JobOutcome, JobRun};
pub use kinds::Jobs;
pub use leased::Lease;
pub use limit::Limit;
pub use periodic::{Missed, Periodic};
pub use query::{Depth, JobFilter, JobInfo, JobState, depth, list, record_depth};
pub use retry::RetryPolicy;
pub use worker::Worker;
