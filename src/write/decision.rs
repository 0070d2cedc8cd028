//! What a locked write decided and how it ended: the words the locked driver, commit combining
//! and the repository's front ends share. Entity types only: nothing of sessions, locks or SQL.

use std::sync::Arc;

use sea_orm::EntityTrait;

/// What the caller decided, given the row as reloaded under the lock (`None`: no such row).
pub(crate) enum Decision<E: EntityTrait> {
    /// Write nothing: report the row as read ([`Written::Unchanged`]).
    Keep(E::Model),
    /// Write nothing: there is no such row ([`Written::NotFound`]).
    NotFound,
    /// Write the columns `draft` changed relative to `original` (after `before_save`).
    Update {
        original: E::Model,
        draft: E::ActiveModel,
    },
    /// Insert `draft` (the row was missing).
    Insert(E::ActiveModel),
    /// Delete `original`.
    Delete(E::Model),
}

/// How a locked write ended (the front ends turn it into their public outcome).
#[derive(Debug)]
pub(crate) enum Written<M> {
    Updated(Arc<M>),
    Unchanged(Arc<M>),
    Inserted(Arc<M>),
    Deleted(Arc<M>),
    NotFound,
    LeaseLost,
}

impl<M> Written<M> {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Updated(_) => "updated",
            Self::Unchanged(_) => "unchanged",
            Self::Inserted(_) => "inserted",
            Self::Deleted(_) => "deleted",
            Self::NotFound => "not_found",
            Self::LeaseLost => "lease_lost",
        }
    }
}
