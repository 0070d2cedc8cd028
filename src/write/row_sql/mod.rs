//! The write primitives every write path shares: which columns changed, what the UPDATE checks,
//! the guarded UPDATE that returns the row as the database stores it, and sea-orm's hooks.
//!
//! This module sits below the repository, the locked driver and sections: it knows entities,
//! SQL and the commit's evidence (`commit/`), nothing of sessions, caches or locks.

mod columns;
mod delete;
mod hooks;
mod keys;
mod update;

pub(crate) use columns::*;
pub(crate) use delete::*;
pub(crate) use hooks::*;
pub(crate) use keys::*;
pub(crate) use update::*;
