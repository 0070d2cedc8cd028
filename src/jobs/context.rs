//! What running a job needs, shared by a worker, its steps and its leased jobs' tasks: the
//! session (its connection, cache and policy) and the handlers by kind.

use std::{sync::Arc, time::Duration};

use super::{
    kinds::{Jobs, Kind},
    limit::Limit,
};
use crate::session::Session;

/// A worker's session and handlers. Cheap to clone.
#[derive(Clone, Debug)]
pub(super) struct Context {
    pub(super) session: Session,
    pub(super) jobs: Arc<Jobs>,
    /// The kinds this worker takes, sorted: all of `jobs`' unless narrowed
    /// ([`Worker::only`](super::Worker::only)).
    pub(super) kinds: Arc<[Vec<u8>]>,
    /// Whether the tokens of the kinds' limits were made (`limit::prepare`).
    pub(super) limits_ready: Arc<tokio::sync::OnceCell<()>>,
}

impl Context {
    /// The kinds this worker takes.
    pub(super) fn kinds(&self) -> &[Vec<u8>] {
        &self.kinds
    }

    /// The handler of `kind`, if this worker has one.
    pub(super) fn kind(&self, kind: &[u8]) -> Option<Arc<Kind>> {
        self.jobs.kind(kind)
    }

    /// The limits of `kind` here.
    pub(super) fn limits(&self, kind: &[u8]) -> &[Limit] {
        self.jobs.limits(kind)
    }

    /// Whether `kind` is a leased kind here.
    pub(super) fn is_leased(&self, kind: &[u8]) -> bool {
        self.kind(kind).is_some_and(|k| k.leased().is_some())
    }

    /// The bound on one reply of the database (the session policy's).
    pub(super) fn reply(&self) -> Duration {
        self.session.policy().reply_deadline()
    }
}
