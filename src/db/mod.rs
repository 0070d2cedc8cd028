//! The connection edge (public: [`Bounded`], the connection a claim's finish and a write's
//! hooks are handed, and `mysql_read_committed`): what freshlock knows of a database connection and its pool, knowing SQL
//! but nothing of locks, sessions or repositories — failures and their classes, a deadline on
//! every round trip, `BEGIN` on a live connection and never cut in half, single statements
//! that commit alone, and PostgreSQL behind a transaction pooler.

pub(crate) mod autocommit;
pub(crate) mod begin;
pub(crate) mod deadline;
pub(crate) mod detach;
pub(crate) mod failure;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod held;
#[cfg(any(feature = "mysql", feature = "postgres"))]
pub(crate) mod inline;
pub(crate) mod live;
pub(crate) mod own;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod pinned;
pub(crate) mod pool;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod prepared;
pub(crate) mod savepoint;
pub(crate) mod txn;

pub use deadline::Bounded;
#[cfg(feature = "mysql")]
pub use pool::mysql_read_committed;
