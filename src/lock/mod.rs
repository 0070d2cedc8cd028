//! Locks that serialize writers of one key.
//!
//! A lock backend is one small trait, [`LockBackend`], used through `Arc<dyn LockBackend>` so a
//! session can be given any backend chosen at run time. Backends come in two scopes
//! ([`LockScope`]):
//!
//! - **lease** locks are taken *before* the transaction opens and released *after* it commits
//!   (the in-process [`LocalLock`]; a lock table, Redis or MySQL `GET_LOCK` fit here too). Their
//!   [`LockGuard`] is released explicitly with [`LockGuard::release`].
//! - **transaction** locks are taken *inside* the transaction and end with it
//!   (`SELECT … FOR UPDATE` on a lock row, `pg_advisory_xact_lock`): such a backend implements
//!   [`TransactionLock::lock_in_transaction`] and has nothing to release.
//!
//! How often to try, how long to wait and what to do when the lock cannot be had is the caller's
//! [`LockPolicy`], applied by the session — backends only try once, waiting at most the time they
//! are given.

mod any;
mod backoff;
pub(crate) mod bound;
#[cfg(feature = "redis")]
mod fence;
pub(crate) mod floor;
pub(crate) mod holder;
mod kind;
pub(crate) mod lease_row;
mod local;
#[cfg(feature = "mysql")]
mod mysql_named;
mod name;
mod pg_advisory;
mod policy;
#[cfg(feature = "redis")]
mod redis;
mod row;
pub(crate) mod sql;
mod table;
mod traits;
mod wait;

pub use kind::LockKind;
pub use local::LocalLock;
#[cfg(feature = "mysql")]
pub use mysql_named::MySqlNamedLock;
pub use name::LockName;
pub use pg_advisory::PgAdvisoryLock;
pub use policy::{LockPolicy, OnLockFailure};
#[cfg(feature = "redis")]
pub use redis::RedisLock;
pub use row::RowLock;
pub use table::TableLock;
pub use traits::{
    Fencing, LeaseCheck, LeaseLock, LockBackend, LockGuard, LockRole, LockScope, Renewal,
    TransactionLock,
};
