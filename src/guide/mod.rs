//! The guide: one page per topic, each a module with no items of its own. Every example in it is
//! a doctest, so `cargo test` fails when the guide and the library disagree.
//!
//! Start with [`concepts`]; then the page you need:
//!
//! - [`concepts`] — sessions, the identity map, repositories, what `locked_update` does step by
//!   step, and the Drupal report's fix side by side.
//! - [`lock_backends`] — which lock to choose, what each costs and what happens when its holder
//!   crashes; the lock policy.
//! - [`several_rows`] — several rows in one transaction, sections, repositories bound to a
//!   transaction, `SKIP LOCKED`, hooks, the one-statement `save`.
//! - [`keyed_jobs`] — a job queue in your own database for Celery users: retries, uniqueness,
//!   per-key order, leases for long work, schedules, batches, shutdown.
//! - [`claims`] — new → processing → done with a lease, for a queue you already have.
//! - [`guarantees`] — what is promised, under which faults, and how it was checked.
//! - [`topologies`] — PgBouncer in transaction mode, read replicas, Galera, MySQL at READ
//!   COMMITTED.
//! - [`testing`] — testing your own code on in-memory SQLite.
//! - [`operations`] — the CLI, the lock inspector, tracing and metrics, pruning.
//! - [`upgrading`] — every rename between versions, before and after.

#[doc = include_str!("../../docs/concepts.md")]
pub mod concepts {}

#[doc = include_str!("../../docs/lock-backends.md")]
pub mod lock_backends {}

#[doc = include_str!("../../docs/several-rows.md")]
pub mod several_rows {}

#[doc = include_str!("../../docs/keyed-jobs.md")]
pub mod keyed_jobs {}

#[doc = include_str!("../../docs/claims.md")]
pub mod claims {}

#[doc = include_str!("../../docs/guarantees.md")]
pub mod guarantees {}

#[doc = include_str!("../../docs/topologies.md")]
pub mod topologies {}

#[doc = include_str!("../../docs/testing.md")]
pub mod testing {}

#[doc = include_str!("../../docs/operations.md")]
pub mod operations {}

#[doc = include_str!("../../docs/upgrading.md")]
pub mod upgrading {}
