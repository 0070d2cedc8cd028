#![doc = include_str!("../README.md")]
//!
//! # Layout
//!
//! - `session.rs` — [`Session`]: one unit of work (connection, identity map, lock, policy).
//! - `identity_map.rs` — the per-session cache of `Arc<Model>` by entity and primary key.
//! - `repository.rs` — [`Repository`]: `load`, `load_many`, `load_fresh`, `reset_cache`, and the
//!   locked writes' front ends (`locked_update`, `locked_delete`, `get_or_insert`,
//!   `update_or_insert`).
//! - `unlocked.rs` — the repository's writes without a lock: `insert`, the optimistic `save`,
//!   `optimistic_first`'s one-statement write.
//! - `save.rs` — the statements of one save and one insert, shared by [`Repository`] and
//!   [`TxRepository`].
//! - `engine.rs` — the one engine every locked write runs on: under the locks a front end took,
//!   attempts of a *step* (begin, the step, fence checks, commit with its evidence, cache
//!   effects), retried with backoff, and the release.
//! - `row_step.rs` — one row's reload, the caller's decision and its write (update serving a
//!   combined batch, insert, delete) as a step of the engine.
//! - `locked_update.rs` — the front end behind `locked_update`, `locked_delete`, `get_or_insert`
//!   and `update_or_insert`: takes the row's lock (seated in its room when combining), runs the
//!   row step on the engine, polled in place and detached on cancel.
//! - `write.rs` — the row write steps below every write path, written once: changed columns, the
//!   optimistic guard (version column), the guarded UPDATE that returns the stored row, insert
//!   and delete with sea-orm's hooks.
//! - `locking.rs` — taking and releasing a section's lock under the policy (in-process queue,
//!   lease, transaction-scoped lock).
//! - `decision.rs` — what a locked write decided (update, insert, delete, keep) and what it
//!   wrote: the words the locked driver, commit combining and the front ends share.
//! - `combine.rs` — commit combining, a layer on the driver: the waiters of a hot row sit in its
//!   room and are served by the holder's transaction (rooms, seats, the holder's batch, the
//!   waiter's side).
//! - `section.rs` — [`Session::with_lock`] and [`Session::section`]: a section takes its locks
//!   in one canonical order and runs its work as a step of the engine.
//! - `tx.rs` — [`Tx`] and [`TxRepository`]: a section's transaction and the repositories bound
//!   to it.
//! - `many.rs` — locked writes built on a retrying section: several rows in one transaction
//!   (`locked_update_many`, `locked_update_pair`), and `locked_update_with`.
//! - `row.rs` — how a row of any entity is named (cache key, lock name, error text).
//! - `outcome.rs` — [`UpdateOutcome`], [`DeleteOutcome`], [`Report`], [`LockReport`],
//!   [`SaveOutcome`].
//! - `lock/` — the [`LockBackend`] trait, [`LockPolicy`], lock names and the in-process
//!   [`LocalLock`].
//! - `claim.rs` — [`Claims`]: claim / finish with a lease (new → processing → done).
//! - `inspect.rs` — the lock inspector's functions (held and expired leases, clearing stale ones).
//! - `jobs/` — [`jobs`]: keyed jobs — enqueue in the caller's transaction (`mod.rs`), the job
//!   table's statements (`store.rs`), the worker, a step of the engine (`worker.rs`), the
//!   operator's depth / list / retry / discard (`admin.rs`).
//! - `schema.rs` — freshlock's tables, as a migration.
//! - `pool.rs` — what freshlock keeps of a pool (default isolation, whether it runs behind a
//!   transaction pooler, commit combining's rooms) and `Autocommit`, its single statements.
//! - `registry.rs` — state kept for a live object freshlock cannot extend (a pool, a lock
//!   backend), found by the object's identity and held weakly.
//! - `transaction_pooler.rs` — `transaction_pooler` (feature `postgres`): PgBouncer in
//!   transaction mode.
//! - `commit.rs` — commit evidence (markers; PostgreSQL's transaction id within a server
//!   incarnation): a commit whose reply was lost is resolved, never run twice.
//! - `db_error.rs` — what kind of failure a database error is (transient, lock timeout, …).
//! - `deadline.rs` — every round trip of a locked write has a deadline (a reply that never
//!   comes reads as a lost connection).
//! - `detach.rs` — futures never cut in half: a locked section's driver and every `BEGIN` end
//!   in a task of their own when their caller is dropped.
//! - `live.rs` — connections that died idle in the pool: a `BEGIN` or a read that meets one is
//!   tried on another.
//! - `error.rs` — [`Error`], [`LockError`], [`ApplyError`].
//! - `metrics.rs` — [`metrics`]: metric names, recorded with the `metrics` feature.
//! - `testing/` — `testing` (feature `testing`): `TestDatabase`, `Recorder`, `FakeLock`.

// docs.rs: every item gated on a feature shows the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(
    not(test),
    warn(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)
)]

// Without a database driver nothing here can connect: say so instead of a page of errors.
#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
compile_error!(
    "freshlock needs a database backend: enable a feature among `sqlite`, `postgres`, `mysql`"
);

mod claim;
mod commit;
mod database;
mod db;
mod error;
mod identity_map;
pub mod inspect;
pub mod jobs;
mod lock;
mod many;
pub mod metrics;
mod outcome;
mod repository;
pub mod schema;
mod session;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "postgres")]
pub mod transaction_pooler;
mod tx;
mod tx_repository;
mod unlocked;
mod write;

pub use claim::{Claim, ClaimOutcome, Claims, FinishOutcome};
pub use database::Db;
pub use db::deadline::Bounded;
#[cfg(feature = "mysql")]
pub use db::pool::mysql_read_committed;

pub use error::{ApplyError, BoxError, Error, LockError, ReleaseError, Result};
pub use identity_map::CacheStats;
#[cfg(feature = "mysql")]
pub use lock::MySqlNamedLock;
#[cfg(feature = "redis")]
pub use lock::RedisLock;
pub use lock::{
    Fencing, LeaseCheck, LeaseLock, LocalLock, LockBackend, LockGuard, LockKind, LockName,
    LockPolicy, LockRole, LockScope, OnLockFailure, PgAdvisoryLock, Renewal, RowLock, TableLock,
    TransactionLock,
};
pub use outcome::{
    DeleteOutcome, DeleteReport, LockReport, ManyReport, Report, SaveOutcome, UpdateOutcome,
    UpdateReport,
};
pub use repository::{PrimaryKeyOf, Repository};
pub use session::{Session, SessionBuilder};
pub use tx::{ForUpdate, Tx};
pub use tx_repository::TxRepository;
pub use write::row::lock_name;
pub use write::section::{Section, SectionOutcome, SectionReport, SectionWork, section_work};
