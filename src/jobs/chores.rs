//! A worker's periodic chores: when each is due, shared by a worker's clones.

use std::{sync::Mutex, time::Duration};

/// How often a worker that found nothing to do looks for stranded queued jobs, and how often a
/// worker with leased kinds reclaims expired leases.
pub(super) const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How often [`Worker::run`](super::Worker::run) (one of a worker's clones) records the queue's
/// depth gauge, with the `metrics` feature.
pub(super) const GAUGE_EVERY: Duration = Duration::from_secs(10);

/// How often [`Worker::run`](super::Worker::run) (one of a worker's clones) says which kinds it
/// takes (`freshlock_worker_kind`; a kind counts as taken for three of these).
pub(super) const ADVERTISE_EVERY: Duration = Duration::from_secs(10);

/// Whether a worker's periodic chore in `slot` is due (at most once per [`SWEEP_EVERY`]),
/// marking it done now if so.
pub(super) fn due(slot: &Mutex<Option<tokio::time::Instant>>) -> bool {
    due_every(slot, SWEEP_EVERY)
}

/// Whether a worker's periodic chore in `slot` is due (at most once per `every`), marking it
/// done now if so.
pub(super) fn due_every(slot: &Mutex<Option<tokio::time::Instant>>, every: Duration) -> bool {
    let now = tokio::time::Instant::now();
    let mut last = slot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if last.is_some_and(|at| now.duration_since(at) < every) {
        return false;
    }
    *last = Some(now);
    true
}
