//! Errors of the data layer ([`Error`]) and of lock backends ([`LockError`]).
//!
//! Expected outcomes — a row that does not exist, nothing to change, a lock held by someone else
//! under a "proceed" policy — are values ([`crate::UpdateOutcome`], [`crate::LockReport`]), not
//! errors.

use std::{fmt, sync::Arc, time::Duration};

use crate::db::failure::Failure;

/// A boxed foreign error (driver, server), kept as the `source` of ours.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with freshlock's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in a session or repository call.
///
/// `target` fields name the row as `"{table}:{key}"` (for example `node:1`; a composite key as
/// `order_line:7,2`, a string key as `tag:'x'`, a schema first as `app.node:1`), or name the
/// table or lock concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database failed while doing `operation` on `target`.
    #[error("database error while {operation} {target}")]
    Database {
        /// What was being done (`"loading"`, `"saving"`, `"beginning a transaction for"`, …).
        operation: &'static str,
        /// The row or table concerned.
        target: String,
        /// The driver's error (a `sea_orm::DbErr`).
        #[source]
        source: BoxError,
    },
    /// The `apply` closure of `locked_update` returned an error; nothing was written.
    #[error("update of {target} aborted by apply")]
    Apply {
        /// The row being updated.
        target: String,
        /// The error `apply` returned.
        #[source]
        source: BoxError,
    },
    /// The work given to [`crate::claim::Claims::finish_with`] returned an error: the claim was not
    /// finished and nothing the work wrote was committed (the claim is still held, as before).
    #[error("finish of claim {claim} aborted by its work")]
    FinishAborted {
        /// The claim's key.
        claim: String,
        /// The error the work returned.
        #[source]
        source: BoxError,
    },
    /// The work of a locked section ([`crate::Session::with_lock`], [`crate::Section`]) returned an
    /// error of its own; its transaction was rolled back. (Database errors and freshlock's own
    /// errors inside the section are returned as they are, not wrapped in this.)
    #[error("locked section {lock} aborted by its work")]
    SectionAborted {
        /// The section's lock (several joined with `+`).
        lock: String,
        /// The error the work returned.
        #[source]
        source: BoxError,
    },
    /// `apply` changed a primary-key column, which would move the update to another row.
    #[error("apply changed the primary key of {target}")]
    PrimaryKeyChanged {
        /// The row being updated.
        target: String,
    },
    /// The lock could not be taken within the policy and the policy says to fail.
    #[error("lock {lock} for {target} not acquired after {tries} tries ({waited:?})")]
    LockNotAcquired {
        /// The row being updated.
        target: String,
        /// The lock's name.
        lock: String,
        /// Tries made.
        tries: u32,
        /// Time spent waiting.
        waited: Duration,
    },
    /// The lock backend failed and the policy says to fail.
    #[error("lock backend failed for {target}")]
    Lock {
        /// The row being updated.
        target: String,
        /// The backend's error.
        #[source]
        source: LockError,
    },
    /// The optimistic guard refused the write on every attempt: the row kept changing between
    /// the reload and the write. Nothing was written.
    #[error("update of {target} conflicted on all {attempts} attempts")]
    Conflict {
        /// The row being updated.
        target: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The connection was lost while the write's `COMMIT` was in flight, and whether it committed
    /// could not be resolved (the database did not answer in time, or a write path without a
    /// commit marker: `insert`, `save`). The write may or may not be in the database; it was not
    /// run again. Read the row to find out before writing it again.
    #[error("the commit of {target} was sent but its outcome is unknown (the connection was lost)")]
    CommitUnknown {
        /// The row or section being written.
        target: String,
        /// Why it could not be resolved.
        #[source]
        source: BoxError,
    },
    /// The declared version column cannot be incremented (it is not an integer, or NULL).
    #[error("version column {column} of {entity} is not a non-null integer")]
    VersionColumn {
        /// The entity's table.
        entity: &'static str,
        /// The column.
        column: &'static str,
    },
    /// A [`crate::Repository::save`] of a row this session has no snapshot of (it was never
    /// loaded, or the cache evicted it): there is nothing to check the write against, so nothing
    /// was written. Load the row first, or use [`crate::Repository::locked_update`].
    #[error(
        "no snapshot of {target} to check the save against: load it first, or use locked_update"
    )]
    NoSnapshot {
        /// The row being saved.
        target: String,
    },
    /// A primary-key value does not fit the entity (wrong number of columns, wrong type).
    #[error("invalid key for {entity}: {reason}")]
    InvalidKey {
        /// The entity's table.
        entity: &'static str,
        /// Why the key was rejected.
        reason: String,
    },
    /// A job that cannot be enqueued (its payload does not serialize).
    #[error("invalid job of kind {kind:?}: {reason}")]
    InvalidJob {
        /// The job's kind.
        kind: String,
        /// Why the job was rejected.
        reason: String,
    },
    /// A claim's lease must be at least a millisecond long.
    #[error("invalid lease {lease:?}: a claim's lease must be at least 1 ms")]
    InvalidLease {
        /// The lease given.
        lease: Duration,
    },
    /// A [`crate::LockPolicy`] that cannot work (zero tries, zero TTL, a zero reply timeout), or
    /// [`crate::claim::Claims`] with a zero reply timeout.
    #[error("invalid lock policy: {reason}")]
    InvalidPolicy {
        /// Why the policy was rejected.
        reason: &'static str,
    },
    /// The read replica given to [`crate::SessionBuilder::read_from`] is another kind of
    /// database than the primary.
    #[error("the read replica is a {replica} database, the primary a {primary} one")]
    InvalidReplica {
        /// The primary's backend.
        primary: String,
        /// The replica's backend.
        replica: String,
    },
    /// The pool cannot run behind a transaction pooler (PgBouncer in transaction mode) as it is
    /// set up — refused by `transaction_pooler::adopt` — or a statement met another
    /// client's prepared statement on a server connection the pooler shares (a pool that reaches
    /// a pooler without being adopted). Never taken for a busy lock: no call goes on without
    /// its lock because of it.
    #[error("transaction pooler: {reason}")]
    TransactionPooler {
        /// What is missing, or what clashed.
        reason: String,
        /// The driver's error, when a statement failed.
        #[source]
        source: Option<BoxError>,
    },
    /// The task running the locked section ended without an answer (the runtime is shutting
    /// down, or freshlock has a bug). Its transaction was rolled back and its lock released.
    #[error("the locked section for {target} ended without an answer")]
    Interrupted {
        /// The row being updated.
        target: String,
    },
}

impl Error {
    /// Whether the failure is transient: running the same transaction again may succeed
    /// (deadlock, serialization failure, lock timeout, busy SQLite, lost connection).
    /// `locked_update` already retries these within its policy's `write_attempts`.
    pub fn is_transient(&self) -> bool {
        let transient = |source: &BoxError| {
            source
                .downcast_ref::<sea_orm::DbErr>()
                .is_some_and(|e| crate::db::failure::classify(e).is_transient())
        };
        match self {
            Self::Database { source, .. } => transient(source),
            // A lock statement (a fence check, a lease) that failed on a lost connection.
            Self::Lock {
                source: LockError::Backend { source, .. },
                ..
            } => transient(source),
            _ => false,
        }
    }

    /// Whether a table freshlock needs does not exist (its migrations were not run): no retry
    /// helps until they are.
    pub(crate) fn is_missing_table(&self) -> bool {
        match self {
            Self::Database { source, .. } => is_failure(source, Failure::MissingTable),
            _ => false,
        }
    }

    /// Whether a round trip got no reply within its deadline (`deadline.rs`): its connection
    /// is gone silent, and nothing more is to be sent on it, a rollback included.
    pub(crate) fn is_no_reply(&self) -> bool {
        match self {
            Self::Database { source, .. } => no_reply(source),
            Self::Lock { source, .. } => source.is_no_reply(),
            _ => false,
        }
    }
}

/// Whether `source` is a database error that [`classify`](crate::db::failure::classify)
/// reads as `failure`.
fn is_failure(source: &BoxError, failure: Failure) -> bool {
    (source.downcast_ref::<sea_orm::DbErr>())
        .is_some_and(|e| crate::db::failure::classify(e) == failure)
}

/// Whether `source` is a round trip cut by its deadline (see `deadline.rs`).
fn no_reply(source: &BoxError) -> bool {
    (source.downcast_ref::<sea_orm::DbErr>()).is_some_and(crate::db::failure::is_no_reply)
}

/// What went wrong in a lock backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Lock names must not be empty.
    #[error("lock name is empty")]
    EmptyName,
    /// A table freshlock needs does not exist: run the migration it names.
    #[error(
        "table {table} does not exist: run the migration {migration} (freshlock::schema::migrations())"
    )]
    MissingTable {
        /// The missing table.
        table: &'static str,
        /// The migration that creates it.
        migration: &'static str,
    },
    /// The backend does not work on this database (for example PostgreSQL advisory locks on
    /// SQLite).
    #[error("the {backend} lock backend does not support {database}")]
    Unsupported {
        /// The backend's kind.
        backend: &'static str,
        /// The database it was used with.
        database: String,
    },
    /// No lock backend has this name.
    #[error(
        "unknown lock backend {name:?} (expected local, table, row, pg_advisory, mysql_named or redis)"
    )]
    UnknownKind {
        /// The name given.
        name: String,
    },
    /// The backend failed (server unreachable, query failed).
    #[error("{backend} lock backend failed")]
    Backend {
        /// The backend's [`kind`](crate::LockBackend::kind).
        backend: &'static str,
        /// What failed.
        #[source]
        source: BoxError,
    },
}

/// A lock release that failed after the transaction ended ([`crate::LockReport::release_error`]):
/// the backend's [`LockError`], shared by the clones of a report. Its text names the error and
/// its causes; two compare equal when they are the same failure (one release's report and its
/// clones).
#[derive(Clone, Debug)]
pub struct ReleaseError(Arc<LockError>);

impl ReleaseError {
    pub(crate) fn new(error: LockError) -> Self {
        Self(Arc::new(error))
    }

    /// The backend's error.
    pub fn error(&self) -> &LockError {
        &self.0
    }
}

impl fmt::Display for ReleaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = std::error::Error::source(&*self.0);
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

// The text carries the whole chain already; the typed error is `error()`.
impl std::error::Error for ReleaseError {}

impl PartialEq for ReleaseError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ReleaseError {}

/// The error an `apply` closure returns to abort `locked_update`.
///
/// Any error converts into it with `?` (or `ApplyError::from`), and a message with
/// [`ApplyError::msg`]. It does not implement `std::error::Error` itself, so that the blanket
/// conversion stays possible; `locked_update` hands its source on in [`Error::Apply`].
#[derive(Debug)]
pub struct ApplyError(BoxError);

impl ApplyError {
    /// An apply error carrying just a message.
    pub fn msg(message: impl Into<String>) -> Self {
        Self(message.into().into())
    }

    /// The underlying error.
    pub fn into_inner(self) -> BoxError {
        self.0
    }

    /// The error as the type it was made from, if it was a `T` (`?` on a `T`, or
    /// `ApplyError::from(t)`).
    pub fn downcast_ref<T: std::error::Error + 'static>(&self) -> Option<&T> {
        self.0.downcast_ref::<T>()
    }

    /// Whether the error was made from a `T`.
    pub fn is<T: std::error::Error + 'static>(&self) -> bool {
        self.0.is::<T>()
    }
}

impl AsRef<dyn std::error::Error + Send + Sync + 'static> for ApplyError {
    fn as_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl<E: Into<BoxError>> From<E> for ApplyError {
    fn from(error: E) -> Self {
        Self(error.into())
    }
}

impl std::fmt::Display for ApplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

/// The error a caller's work (a section's, a finish's) returned, as the caller gets it:
/// freshlock's own errors as they are, a database error as [`Error::Database`] of `operation`
/// on `target` (so that [`Error::is_transient`] reads it), anything else as `aborted` makes it.
pub(crate) fn work_error(
    operation: &'static str,
    target: &impl ToString,
    error: ApplyError,
    aborted: impl FnOnce(BoxError) -> Error,
) -> Error {
    let source = error.into_inner();
    let source = match source.downcast::<Error>() {
        Ok(error) => return *error,
        Err(source) => source,
    };
    match source.downcast::<sea_orm::DbErr>() {
        Ok(e) => database(operation, target, *e),
        Err(source) => aborted(source),
    }
}

pub(crate) fn database(
    operation: &'static str,
    target: &impl ToString,
    source: sea_orm::DbErr,
) -> Error {
    if crate::db::failure::classify(&source) == crate::db::failure::Failure::PoolerClash {
        return pooler_clash(operation, &target.to_string(), Box::new(source));
    }
    Error::Database {
        operation,
        target: target.to_string(),
        source: Box::new(source),
    }
}

/// The error of a statement that met another client's prepared statement behind a transaction
/// pooler.
pub(crate) fn pooler_clash(operation: &str, target: &str, source: BoxError) -> Error {
    Error::TransactionPooler {
        reason: format!(
            "{operation} {target}: a prepared statement clashed on a server connection the pooler \
             shares between clients; connect with freshlock::transaction_pooler::connect (or \
             adopt the pool) and set server_reset_query_always = 1"
        ),
        source: Some(source),
    }
}

impl LockError {
    /// Whether the backend's statement got no reply within its deadline (its connection is
    /// gone silent: nothing more is to be sent on it).
    pub(crate) fn is_no_reply(&self) -> bool {
        matches!(self, Self::Backend { source, .. } if no_reply(source))
    }

    /// Whether the backend failed because a statement met another client's prepared statement
    /// behind a transaction pooler: a misconfiguration, never a busy lock.
    pub(crate) fn is_pooler_clash(&self) -> bool {
        match self {
            LockError::Backend { source, .. } => is_failure(source, Failure::PoolerClash),
            _ => false,
        }
    }
}
