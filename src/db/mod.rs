//! The connection edge: what freshlock knows of a database connection and its pool, knowing SQL
//! but nothing of locks, sessions or repositories — failures and their classes, a deadline on
//! every round trip, `BEGIN` on a live connection and never cut in half, single statements
//! that commit alone, and PostgreSQL behind a transaction pooler.

pub(crate) mod autocommit;
pub(crate) mod begin;
pub(crate) mod deadline;
pub(crate) mod detach;
pub(crate) mod failure;
#[cfg(feature = "mysql")]
pub(crate) mod inline;
pub(crate) mod live;
pub(crate) mod pool;
pub(crate) mod savepoint;
