//! The old names of items that moved off the crate root in 0.2 (see the CHANGELOG's
//! migration notes): a deprecated alias for each type, kept for one release so code written
//! against 0.1 compiles with a warning that names the new path. Traits cannot be aliased: the
//! backend traits stay reachable at their old paths, hidden from the docs.
//!
//! Code written against 0.1 still compiles:
//!
//! ```
//! #![allow(deprecated)]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use freshlock::{Claims, LeaseLock, LocalLock, LockGuard, LockName, TableLock};
//! let conn = sea_orm::Database::connect("sqlite::memory:").await?;
//! let (_claims, _lock) = (Claims::new(&conn), TableLock::new(&conn));
//! let name = LockName::new("ham:7")?;
//! let ttl = Duration::from_secs(5);
//! let guard: Option<Box<dyn LockGuard>> =
//!     LocalLock::new().acquire(&name, Duration::ZERO, ttl).await?;
//! assert!(guard.is_some());
//! # Ok(())
//! # }
//! ```
//!
//! and is told where each name went:
//!
//! ```compile_fail
//! #![deny(deprecated)]
//! let _ = freshlock::LockName::new("ham:7");
//! ```

#![allow(deprecated)]

/// A deprecated alias `$old` of the type now at `$path`, its note (`$new`) naming the new path.
macro_rules! moved {
    ($($(#[$cfg:meta])* $old:ident $(<$lt:lifetime>)? => $new:literal $path:path;)*) => {$(
        $(#[$cfg])*
        #[doc = concat!("Moved: ", $new, ".")]
        #[deprecated(since = "0.2.0", note = $new)]
        pub type $old $(<$lt>)? = $path;
    )*};
}

moved! {
    Claims => "use freshlock::claim::Claims" crate::claim::Claims;
    Claim => "use freshlock::claim::Claim" crate::claim::Claim;
    ClaimOutcome => "use freshlock::claim::ClaimOutcome" crate::claim::ClaimOutcome;
    FinishOutcome => "use freshlock::claim::FinishOutcome" crate::claim::FinishOutcome;
    LocalLock => "use freshlock::lock::LocalLock" crate::lock::LocalLock;
    TableLock => "use freshlock::lock::TableLock" crate::lock::TableLock;
    RowLock => "use freshlock::lock::RowLock" crate::lock::RowLock;
    PgAdvisoryLock => "use freshlock::lock::PgAdvisoryLock" crate::lock::PgAdvisoryLock;
    #[cfg(feature = "mysql")]
    MySqlNamedLock => "use freshlock::lock::MySqlNamedLock" crate::lock::MySqlNamedLock;
    #[cfg(feature = "redis")]
    RedisLock => "use freshlock::lock::RedisLock" crate::lock::RedisLock;
    LockName => "use freshlock::lock::LockName" crate::lock::LockName;
    LeaseCheck => "use freshlock::lock::backend::LeaseCheck" crate::lock::backend::LeaseCheck;
    LockRole<'a> => "use freshlock::lock::backend::LockRole" crate::lock::backend::LockRole<'a>;
    LockScope => "use freshlock::lock::backend::LockScope" crate::lock::backend::LockScope;
    ReleaseError => "use freshlock::lock::backend::ReleaseError" crate::lock::backend::ReleaseError;
}

/// Moved to `freshlock::db::Bounded`.
#[deprecated(since = "0.2.0", note = "use freshlock::db::Bounded")]
pub type Bounded<'c, C> = crate::db::Bounded<'c, C>;

/// Moved to `freshlock::db::mysql_read_committed`.
#[cfg(feature = "mysql")]
#[deprecated(since = "0.2.0", note = "use freshlock::db::mysql_read_committed")]
pub fn mysql_read_committed(options: &mut sea_orm::ConnectOptions) -> &mut sea_orm::ConnectOptions {
    crate::db::mysql_read_committed(options)
}

#[doc(hidden)]
pub use crate::lock::backend::{Fencing, LeaseLock, LockGuard, Renewal, TransactionLock};
