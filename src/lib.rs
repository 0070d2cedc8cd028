// The front page is the README. Its links to the guide name `docs/*.md`, which is what GitHub
// shows; the definitions below come first, and in Markdown the first definition of a link label
// wins, so on docs.rs the same links reach the guide's modules (and rustdoc checks them).
#![doc = "[guide-concepts]: crate::guide::concepts"]
#![doc = "[guide-locks]: crate::guide::lock_backends"]
#![doc = "[guide-rows]: crate::guide::several_rows"]
#![doc = "[guide-jobs]: crate::guide::keyed_jobs"]
#![doc = "[guide-claims]: crate::guide::claims"]
#![doc = "[guide-guarantees]: crate::guide::guarantees"]
#![doc = "[guide-topologies]: crate::guide::topologies"]
#![doc = "[guide-testing]: crate::guide::testing"]
#![doc = "[guide-operations]: crate::guide::operations"]
#![doc = "[guide-upgrading]: crate::guide::upgrading"]
#![doc = include_str!("../README.md")]
#![doc = "\n## Modules\n\nThe crate root holds what an application names every day ([`Db`], \
[`Session`], [`Repository`], [`LockPolicy`], the outcomes and errors); [`guide`] is the guide; \
[`claim`], [`lock`], [`db`], [`jobs`], [`inspect`], [`schema`] and [`metrics`] hold what fewer \
users need."]
// Layout (for contributors; users read the guide).
//
// Data flows one way: application → front ends → `write/` → `lock/`, `commit/` → `db/`. Each
// folder may use the ones below it and never one above (the import graph has no circle).
//
// - **Front ends** (top level) translate calls into steps and own nothing of the engine:
//   `database.rs` ([`Db`]: a pool and what freshlock keeps of it, made once per pool and shared
//   by the sessions made from it — with commit combining's rooms), `session.rs` ([`Session`],
//   [`SessionBuilder`]), `repository.rs` ([`Repository`]: loads and the locked writes),
//   `many.rs` (several rows, `locked_update_with`), `unlocked.rs` (insert, the guarded `save`,
//   `optimistic_first`), `tx.rs` / `tx_repository.rs` ([`Tx`], [`TxRepository`]: a section's
//   transaction and its repositories), `claim.rs` ([`Claims`]), `inspect.rs`,
//   `transaction_pooler.rs` (feature `postgres`), `identity_map.rs` (the session's cache, which
//   knows nothing of locks or SQL), `outcome.rs`, `error.rs`, `metrics.rs`, `setters.rs` (the
//   builders' setters, written once), `erased.rs` (the one type erasure: the cache, a
//   section's snapshots and combining's rooms hold any entity's values through it, each keyed
//   by the value type's `TypeId`; why a type map and not column values is said there).
// - **`write/`** — the engine and its steps: `engine.rs` (the one attempt loop: begin, step,
//   fence checks, commit with evidence, cache effects, retries), `locking.rs` (a section's lock
//   under the policy), `fold.rs` (what a lock adds to a row step's statement, in one place),
//   `row_step.rs` (one row's reload, decision and write), `rows_step.rs` (several rows', for
//   `locked_update_many` / `_pair` / `_with`), `row_write.rs` (the one row write both use:
//   hooks, key check, guard, UPDATE with evidence), `locked_update.rs` (its front door,
//   polled in place, detached on cancel), `room.rs` / `combine.rs` (commit combining: rooms and
//   seats, the holder's batch), `section.rs`, `entity.rs` (what an entity needs to be
//   written, said once), `row.rs` (how a row is named, and the one
//   primary-key check), `decision.rs`, `save.rs`, `row_sql/` (the SQL of a row write:
//   columns, the guarded UPDATE, DELETE, hooks, keys), and `flights/` (`locked_update` in two
//   round trips on a held connection, with the engine's rules). It may not name a front end.
// - **`jobs/`** — keyed jobs, one concept per file: the job words (`job.rs`, a job's id
//   among them), enqueueing (`enqueue.rs`), what a handler is (`handler.rs`), retry policy
//   (`retry.rs`), handlers by kind (`kinds.rs`), periodic kinds (`periodic.rs`), what running
//   needs (`context.rs`), the engine step (`step.rs` with `take.rs`, `attempt.rs`, `finish.rs`,
//   `record.rs`, `deferred.rs`, `run.rs`, `catch.rs` for panics), leased jobs (`leased.rs`,
//   `lease.rs`), the worker loop (`worker.rs`) and its chores (`chores.rs`), wake-ups, what the
//   queue holds (`query.rs`), what an operator does to it (`admin.rs`) and cancelling
//   (`cancel.rs`: the call, and the step's half), limits (`limit.rs`: what a limit is;
//   `admit.rs`: the take's admission of jobs under them), stored states (`state.rs`) and the
//   table's statements (`store/`). `mod.rs` holds the docs and the public names only: each
//   file imports from the file that defines what it uses, and none from a file above it. It
//   runs on `write/`'s engine, or, on a session with two flights, on a held connection with
//   the engine's rules (`flights/`).
// - **`commit/`** — commit and rollback (`transaction.rs`) and the one evidence API
//   (`evidence.rs`: `Plan` says whether a write's statement returns its transaction id or
//   writes a marker), markers and their sweep (`marker.rs`), resolving a lost reply
//   (`resolve.rs`). It knows nothing of locks' semantics or sessions.
// - **`lock/`** — the [`LockBackend`] trait and its halves, the backends (each owning its
//   in-process queue: `outside.rs`), [`LockPolicy`], names, fences, a lock statement's deadline
//   (`bound.rs`), and the one lease protocol (`lease.rs`: a leased row checked and extended the
//   same way for the `table` backend, claims and leased jobs; `lease_row.rs`: a named lease row
//   granted). A backend never knows about repositories or sessions.
// - **`db/`** — the connection edge, knowing SQL but nothing of locks or sessions: the pool's
//   state (`pool.rs`), `BEGIN` at the right isolation on a live connection, never cut in half
//   (`begin.rs`, `live.rs`, `detach.rs`), deadlines (`deadline.rs`), failure classes
//   (`failure.rs`), the one savepoint helper (`savepoint.rs`), single statements that commit
//   alone (`autocommit.rs`), values written into a message's text (`inline/`, per dialect),
//   a connection held for a message of several statements (`pinned.rs`), a transaction on it
//   whose `BEGIN` rides with its first statement (`held.rs`), and the transaction a `Tx` runs
//   in, sea-orm's or that one (`txn.rs`).
// - **`guide/`** — the guide's pages, doc-only modules over `docs/*.md` (so every example in
//   them is a doctest).
// - **`schema/`** — freshlock's tables, one migration per file (its `create` is both the step
//   up and part of `create_tables`); **`testing/`** — test support
//   for users (feature `testing`).
// - **`db/own.rs`** — a short transaction of freshlock's own outside the engine (a claim, a
//   fence bump, the inspector's compaction, job admin, upkeep behind a pooler): the one place
//   where such a transaction begins, bounds each round trip, runs again after a deadlock and
//   ends; the bounded rollback lives there too.
//
// The crate root holds what an application names every day ([`Db`], [`Session`],
// [`Repository`], [`LockPolicy`], [`LockKind`], the outcomes and errors). What fewer users need
// sits in public modules: [`claim`] (claims with a lease), [`lock`] (freshlock's backends by
// value, [`lock::LockName`]) and [`lock::backend`] (what a backend author implements), [`db`]
// ([`db::Bounded`]), [`jobs`], [`inspect`], [`schema`], [`metrics`]. The old root names of
// moved types stay one release as deprecated aliases.

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

pub mod claim;
mod commit;
mod database;
pub mod db;
mod erased;
mod error;
pub mod guide;
mod identity_map;
pub mod inspect;
pub mod jobs;
pub mod lock;
mod many;
pub mod metrics;
mod moved;
mod outcome;
mod repository;
pub mod schema;
mod session;
mod setters;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "postgres")]
pub mod transaction_pooler;
mod tx;
mod tx_repository;
mod unlocked;
mod write;

pub use database::Db;
pub use error::{ApplyError, BoxError, Error, LockError, Result};
pub use identity_map::CacheStats;
pub use lock::{
    kind::LockKind,
    policy::{LockPolicy, OnLockFailure},
    traits::LockBackend,
};
#[allow(deprecated)]
pub use moved::*;
pub use outcome::{
    DeleteOutcome, DeleteReport, GetOutcome, LockReport, ManyReport, Report, SaveOutcome,
    UpdateOutcome, UpdateReport,
};
pub use repository::{PrimaryKeyOf, Repository};
pub use session::{Session, SessionBuilder};
pub use tx::{ForUpdate, Tx};
pub use tx_repository::TxRepository;
pub use write::row::lock_name;
pub use write::section::{Section, SectionOutcome, SectionReport, SectionWork, section_work};
