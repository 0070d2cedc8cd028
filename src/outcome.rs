//! What a write returns: its outcome and how the lock went.

use std::{sync::Arc, time::Duration};

use crate::{
    error::ReleaseError,
    lock::{LockKind, LockName},
};

/// What `locked_update` did to the row.
#[derive(Debug)]
#[non_exhaustive]
pub enum UpdateOutcome<M> {
    /// `apply` changed at least one column and the change was committed. Holds the row as committed.
    Updated(Arc<M>),
    /// `apply` changed nothing (or set columns to the values they had): no UPDATE was sent.
    /// Holds the row as read under the lock.
    Unchanged(Arc<M>),
    /// The row was missing and was inserted
    /// ([`update_or_insert`](crate::Repository::update_or_insert)). Holds the row as stored.
    Inserted(Arc<M>),
    /// No row has this key (it never existed or was deleted): nothing was written.
    NotFound,
    /// The lease lock was lost before the write (it expired, and another holder took it):
    /// the fence check in the write's transaction refused, nothing was written, and the row keeps
    /// what the newer holder wrote. Retry if the change still applies.
    LeaseLost,
}

impl<M> UpdateOutcome<M> {
    /// The row, unless it was not found.
    pub fn model(&self) -> Option<&Arc<M>> {
        match self {
            Self::Updated(model) | Self::Unchanged(model) | Self::Inserted(model) => Some(model),
            Self::NotFound | Self::LeaseLost => None,
        }
    }

    /// Whether a change was committed (an update or an insert).
    pub fn is_updated(&self) -> bool {
        matches!(self, Self::Updated(_) | Self::Inserted(_))
    }
}

/// What [`get_or_insert`](crate::Repository::get_or_insert) (and
/// [`TxRepository::get_or_insert`](crate::TxRepository::get_or_insert)) returns: the row, and
/// whether this call created it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum GetOutcome<M> {
    /// The row existed (cached, read, or created first by a concurrent caller).
    Found(Arc<M>),
    /// This call created the row (from its `init`, as stored).
    Created(Arc<M>),
}

impl<M> GetOutcome<M> {
    /// The row, found or created.
    pub fn model(&self) -> &Arc<M> {
        match self {
            Self::Found(model) | Self::Created(model) => model,
        }
    }

    /// The row, found or created.
    pub fn into_model(self) -> Arc<M> {
        match self {
            Self::Found(model) | Self::Created(model) => model,
        }
    }

    /// Whether this call created the row.
    pub fn is_created(&self) -> bool {
        matches!(self, Self::Created(_))
    }
}

/// What [`locked_delete`](crate::Repository::locked_delete) did to the row.
#[derive(Debug)]
#[non_exhaustive]
pub enum DeleteOutcome<M> {
    /// The row was deleted. Holds it as it was, read under the lock just before.
    Deleted(Arc<M>),
    /// No row has this key: nothing was deleted.
    NotFound,
    /// The lease lock was lost before the delete (fencing refused): nothing was deleted.
    LeaseLost,
}

/// How the lock of one locked section went.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockReport {
    /// The backend's [`kind`](crate::LockBackend::kind).
    pub backend: LockKind,
    /// The lock's name (`"{table}:{key}"`).
    pub name: LockName,
    /// Whether the lock was held during the section. `false` means the policy let the update
    /// proceed without it (see [`crate::OnLockFailure::Proceed`]).
    pub held: bool,
    /// How many tries it took (or were made in vain).
    pub tries: u32,
    /// How long the section waited for the lock.
    pub waited: Duration,
    /// The fence token of the grant, for backends that issue one (`mysql_named` issues one per
    /// checked transaction: the write's, see [`crate::lock::backend::Fencing::fence`]).
    pub fence: Option<u64>,
    /// Set when releasing the lock failed *after* the transaction ended: the outcome stands (a
    /// committed update stays committed), and the lease runs out by its TTL.
    pub release_error: Option<ReleaseError>,
}

/// The result of a successful locked write: what happened to the row, and how the lock went.
#[derive(Debug)]
#[non_exhaustive]
pub struct Report<O> {
    /// What happened to the row.
    pub outcome: O,
    /// How the lock went.
    pub lock: LockReport,
    /// How many times the locked section ran (1 unless a conflict or a transient error made it
    /// start again).
    pub attempts: u32,
    /// How many of those attempts the optimistic guard refused (the row had changed).
    pub conflicts: u32,
    /// How many writes the committing transaction carried: 1, unless the session combines
    /// commits ([`crate::SessionBuilder::combine_commits`]) and this write shared its commit
    /// with other writers of the row.
    pub batch: u32,
}

impl<O> Report<O> {
    /// The same report with its outcome mapped.
    pub(crate) fn map<P>(self, f: impl FnOnce(O) -> P) -> Report<P> {
        Report {
            outcome: f(self.outcome),
            lock: self.lock,
            attempts: self.attempts,
            conflicts: self.conflicts,
            batch: self.batch,
        }
    }
}

/// What [`locked_update`](crate::Repository::locked_update) and
/// [`update_or_insert`](crate::Repository::update_or_insert) return.
pub type UpdateReport<M> = Report<UpdateOutcome<M>>;

/// What [`locked_delete`](crate::Repository::locked_delete) returns.
pub type DeleteReport<M> = Report<DeleteOutcome<M>>;

/// What [`crate::Repository::save`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum SaveOutcome<M> {
    /// The changed columns were written, and the row held the snapshot's values for every column
    /// the caller set. Holds the row as the database stored it.
    Updated(Arc<M>),
    /// Nothing needed writing: the caller set nothing, or only values the row still holds (which
    /// was checked against the database, not against the cache).
    Unchanged,
    /// No row has this key: nothing was written.
    NotFound,
    /// The row changed since the snapshot the save was based on (a set column, or the version
    /// column, no longer holds the snapshot's value): nothing was written and the cached row was
    /// evicted. Load the row again and redo the change on it, or use
    /// [`locked_update`](crate::Repository::locked_update), which does exactly that under a lock.
    Conflict,
}

/// What [`locked_update_many`](crate::Repository::locked_update_many) and
/// [`locked_update_pair`](crate::Repository::locked_update_pair) did.
#[derive(Debug)]
#[non_exhaustive]
pub struct ManyReport<M> {
    /// One outcome per row, in the order the ids were given. When a row is missing nothing is
    /// written: it is [`UpdateOutcome::NotFound`] and the others are
    /// [`UpdateOutcome::Unchanged`]. A lost lease makes them all [`UpdateOutcome::LeaseLost`].
    pub outcomes: Vec<UpdateOutcome<M>>,
    /// How each row's lock went, in the order they were taken (sorted by name).
    pub locks: Vec<LockReport>,
    /// How many times the section ran.
    pub attempts: u32,
    /// How many of those attempts a guard conflict ended.
    pub conflicts: u32,
}

impl<M> ManyReport<M> {
    /// Whether every row was found and the section committed.
    pub fn committed(&self) -> bool {
        !self.outcomes.is_empty()
            && self
                .outcomes
                .iter()
                .all(|o| matches!(o, UpdateOutcome::Updated(_) | UpdateOutcome::Unchanged(_)))
    }
}
