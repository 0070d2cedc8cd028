//! Locks that serialize writers of one key: freshlock's backends and the name of a key.
//!
//! A lock backend is one small trait, [`LockBackend`], used through
//! `Arc<dyn LockBackend>` so a session can be given any backend chosen at run time. Backends come
//! in two scopes ([`LockScope`](backend::LockScope)):
//!
//! - **lease** locks are taken *before* the transaction opens and released *after* it commits
//!   (the in-process [`LocalLock`], the lock table [`TableLock`], Redis, MySQL `GET_LOCK`).
//!   Their [`LockGuard`] is released explicitly.
//! - **transaction** locks are taken *inside* the transaction and end with it
//!   ([`RowLock`]'s `SELECT … FOR UPDATE` on a lock row, [`PgAdvisoryLock`]'s
//!   `pg_advisory_xact_lock`) and have nothing to release.
//!
//! Pick one by value (`Arc::new(TableLock::new(&db))`) or by name
//! ([`LockKind`]). How often to try, how long to wait and what to do when the
//! lock cannot be had is the caller's [`LockPolicy`], applied by the session
//! — backends only try once, waiting at most the time they are given. What a backend is made of,
//! for those who write one, is in [`backend`].

mod any;
pub mod backend;
mod backoff;
pub(crate) mod bound;
#[cfg(feature = "redis")]
mod fence;
pub(crate) mod floor;
pub(crate) mod holder;
pub(crate) mod kind;
pub(crate) mod lease;
pub(crate) mod lease_row;
mod local;
#[cfg(feature = "mysql")]
mod mysql_named;
mod name;
mod outside;
mod pg_advisory;
pub(crate) mod policy;
#[cfg(feature = "redis")]
mod redis;
mod row;
pub(crate) mod sql;
mod table;
pub(crate) mod traits;
mod wait;

pub(crate) use kind::LockKind;
pub use local::LocalLock;
#[cfg(feature = "mysql")]
pub use mysql_named::MySqlNamedLock;
pub use name::LockName;
pub use pg_advisory::PgAdvisoryLock;
pub(crate) use policy::{LockPolicy, OnLockFailure};
#[cfg(feature = "redis")]
pub use redis::RedisLock;
pub use row::RowLock;
pub use table::TableLock;
pub(crate) use traits::{Fencing, LeaseCheck, LockBackend, LockGuard, LockRole};
