//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (cargo feature `metrics`).
//!
//! freshlock records into whatever recorder the application installed (Prometheus exporter,
//! StatsD, …); without the feature, or without a recorder, recording costs nothing. Names:
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | [`LOCK_WAIT`] | histogram (seconds) | `backend`, `held` | time from asking for a row's lock to holding it (or giving up) |
//! | [`ACQUIRE_FAILURES`] | counter | `backend`, `reason` (`busy`/`error`), `policy` (`proceed`/`fail`) | locks not had after the policy's tries |
//! | [`CONFLICTS`] | counter | `entity` | writes refused by the optimistic guard (run again) |
//! | [`LEASES_LOST`] | counter | `backend` | writes refused because the lease expired and was taken over |
//! | [`STALE_TAKEOVERS`] | counter | `backend` | expired leases taken over from a dead or slow holder |
//! | [`UPDATES`] | counter | `entity`, `outcome` | calls of the locked driver (`locked_update`, `locked_delete`, `get_or_insert`, `update_or_insert`) by outcome: `updated`, `unchanged`, `inserted`, `deleted`, `not_found`, `lease_lost`, or the error — `conflict`, `lock_not_acquired`, `interrupted`, `error` |
//! | [`CACHE_HITS`] / [`CACHE_MISSES`] / [`CACHE_EVICTIONS`] | counter | — | identity-map lookups answered from memory / from the database, entries dropped |
//! | [`JOBS`] | counter | `kind`, `outcome` (`completed`/`retrying`/`failed`) | job attempts a worker ran, by how they ended ([`crate::jobs`]) |
//! | [`JOB_WAIT`] | histogram (seconds) | `kind` | from a job's due time to its start (database clock) |
//! | [`JOB_RUN`] | histogram (seconds) | `kind` | a job's handler, from start to end |
//! | [`JOB_ATTEMPTS`] | histogram | `kind` | the attempt a job ended on (completed or failed for good) |
//!
//! | [`JOB_DEPTH`] | gauge | `kind`, `state` (`waiting`/`due`/`failed`) | the queue's depth per kind, as [`crate::jobs::depth`] counts it (summed over keys), set by [`crate::jobs::record_depth`], and every 10 s by a [`crate::jobs::Worker::run`] with this feature on (by kind, in a task its loop does not wait for) |
//!
//! The depth per key is a query, not a metric (keys are unbounded): [`crate::jobs::depth`].
//!
//! Call [`describe`] once after installing the recorder to give exporters units and help texts.
//!
//! Cost: with a recorder installed, every identity-map lookup also increments a counter through
//! it (in most exporters a hash-map lookup, tens of nanoseconds, beside a cached `load` of about
//! 150 ns); the other metrics are recorded once per `locked_update`.

/// Histogram: seconds from asking for a row's lock to holding it (or giving up).
pub const LOCK_WAIT: &str = "freshlock_lock_wait_seconds";
/// Counter: locks not had after the policy's tries.
pub const ACQUIRE_FAILURES: &str = "freshlock_lock_acquire_failures_total";
/// Counter: writes refused by the optimistic guard because the row changed since it was read.
pub const CONFLICTS: &str = "freshlock_conflicts_total";
/// Counter: writes refused because the lease was lost before the write.
pub const LEASES_LOST: &str = "freshlock_leases_lost_total";
/// Counter: expired leases taken over from their holder.
pub const STALE_TAKEOVERS: &str = "freshlock_stale_locks_taken_over_total";
/// Counter: calls of the locked driver by outcome (the ten values are listed in the module's
/// table).
pub const UPDATES: &str = "freshlock_locked_updates_total";
/// Counter: identity-map lookups answered from memory.
pub const CACHE_HITS: &str = "freshlock_cache_hits_total";
/// Counter: identity-map lookups that went to the database.
pub const CACHE_MISSES: &str = "freshlock_cache_misses_total";
/// Counter: identity-map entries evicted (reset, capacity, before a locked reload).
pub const CACHE_EVICTIONS: &str = "freshlock_cache_evictions_total";

/// Counter: job attempts by kind and outcome (`completed`, `retrying`, `failed`).
pub const JOBS: &str = "freshlock_jobs_total";
/// Histogram: seconds from a job's due time to its start.
pub const JOB_WAIT: &str = "freshlock_job_wait_seconds";
/// Histogram: seconds a job's handler ran.
pub const JOB_RUN: &str = "freshlock_job_run_seconds";
/// Histogram: the attempt a job ended on.
pub const JOB_ATTEMPTS: &str = "freshlock_job_attempts";
/// Gauge: jobs per kind and state (`waiting`, `due`, `failed`), as [`crate::jobs::depth`] counts
/// them.
pub const JOB_DEPTH: &str = "freshlock_job_depth";

/// Registers units and descriptions of freshlock's metrics with the installed recorder (does
/// nothing without the `metrics` feature).
pub fn describe() {
    #[cfg(feature = "metrics")]
    describe_all();
}

#[cfg(feature = "metrics")]
fn describe_all() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_histogram!(
        LOCK_WAIT,
        Unit::Seconds,
        "Time from asking for a row's lock to holding it (or giving up)"
    );
    describe_counter!(ACQUIRE_FAILURES, "Locks not had after the policy's tries");
    describe_counter!(CONFLICTS, "Writes refused by the optimistic guard");
    describe_counter!(LEASES_LOST, "Writes refused because the lease was lost");
    describe_counter!(
        STALE_TAKEOVERS,
        "Expired leases taken over from their holder"
    );
    describe_counter!(UPDATES, "locked_update calls by outcome");
    describe_counter!(CACHE_HITS, "Identity-map lookups answered from memory");
    describe_counter!(
        CACHE_MISSES,
        "Identity-map lookups that went to the database"
    );
    describe_counter!(CACHE_EVICTIONS, "Identity-map entries evicted");
    describe_counter!(JOBS, "Job attempts by kind and outcome");
    describe_histogram!(
        JOB_WAIT,
        Unit::Seconds,
        "From a job's due time to its start"
    );
    describe_histogram!(JOB_RUN, Unit::Seconds, "How long a job's handler ran");
    describe_histogram!(JOB_ATTEMPTS, "The attempt a job ended on");
    metrics::describe_gauge!(JOB_DEPTH, "Jobs per kind and state (waiting, due, failed)");
}

#[cfg(feature = "metrics")]
mod record {
    use std::time::Duration;

    use metrics::{counter, histogram};

    pub(crate) fn lock_wait(backend: &'static str, held: bool, waited: Duration) {
        let held = if held { "true" } else { "false" };
        histogram!(super::LOCK_WAIT, "backend" => backend, "held" => held)
            .record(waited.as_secs_f64());
    }

    pub(crate) fn acquire_failure(backend: &'static str, error: bool, proceed: bool) {
        let reason = if error { "error" } else { "busy" };
        let policy = if proceed { "proceed" } else { "fail" };
        counter!(super::ACQUIRE_FAILURES, "backend" => backend, "reason" => reason, "policy" => policy)
            .increment(1);
    }

    pub(crate) fn conflict(entity: &'static str) {
        counter!(super::CONFLICTS, "entity" => entity).increment(1);
    }

    pub(crate) fn lease_lost(backend: &'static str) {
        counter!(super::LEASES_LOST, "backend" => backend).increment(1);
    }

    pub(crate) fn stale_lock_taken_over(backend: &'static str) {
        counter!(super::STALE_TAKEOVERS, "backend" => backend).increment(1);
    }

    pub(crate) fn update(entity: &'static str, outcome: &'static str) {
        counter!(super::UPDATES, "entity" => entity, "outcome" => outcome).increment(1);
    }

    pub(crate) fn cache_hit() {
        counter!(super::CACHE_HITS).increment(1);
    }

    pub(crate) fn cache_miss() {
        counter!(super::CACHE_MISSES).increment(1);
    }

    pub(crate) fn cache_evictions(n: u64) {
        if n > 0 {
            counter!(super::CACHE_EVICTIONS).increment(n);
        }
    }

    pub(crate) fn job(kind: &str, outcome: &'static str, waited: Duration, ran: Duration) {
        let kind = kind.to_owned();
        counter!(super::JOBS, "kind" => kind.clone(), "outcome" => outcome).increment(1);
        histogram!(super::JOB_WAIT, "kind" => kind.clone()).record(waited.as_secs_f64());
        histogram!(super::JOB_RUN, "kind" => kind).record(ran.as_secs_f64());
    }

    pub(crate) fn job_ended(kind: &str, attempt: u32) {
        histogram!(super::JOB_ATTEMPTS, "kind" => kind.to_owned()).record(f64::from(attempt));
    }

    /// The kinds whose depth this process recorded: a kind no longer in the queue goes to 0.
    static DEPTH_KINDS: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());

    /// Sets the depth gauges to `depths`, and to 0 for the kinds recorded before that are not
    /// among them.
    pub(crate) fn job_depth(depths: &[super::KindDepth]) {
        let mut known = DEPTH_KINDS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now: std::collections::BTreeSet<String> =
            depths.iter().map(|d| d.kind.clone()).collect();
        let gone: Vec<super::KindDepth> = (known.difference(&now))
            .map(|kind| super::KindDepth {
                kind: kind.clone(),
                ..Default::default()
            })
            .collect();
        for d in depths.iter().chain(&gone) {
            let states = [
                ("waiting", d.waiting),
                ("due", d.due),
                ("failed", d.failed),
                ("no_worker", d.no_worker),
            ];
            for (state, n) in states {
                metrics::gauge!(super::JOB_DEPTH, "kind" => d.kind.clone(), "state" => state)
                    .set(n as f64);
            }
        }
        *known = now;
    }
}

/// Without the feature every recording is an empty inline function.
#[cfg(not(feature = "metrics"))]
#[allow(clippy::missing_const_for_fn)]
mod record {
    use std::time::Duration;

    #[inline(always)]
    pub(crate) fn lock_wait(_: &'static str, _: bool, _: Duration) {}
    #[inline(always)]
    pub(crate) fn acquire_failure(_: &'static str, _: bool, _: bool) {}
    #[inline(always)]
    pub(crate) fn conflict(_: &'static str) {}
    #[inline(always)]
    pub(crate) fn lease_lost(_: &'static str) {}
    #[inline(always)]
    pub(crate) fn stale_lock_taken_over(_: &'static str) {}
    #[inline(always)]
    pub(crate) fn update(_: &'static str, _: &'static str) {}
    #[inline(always)]
    pub(crate) fn cache_hit() {}
    #[inline(always)]
    pub(crate) fn cache_miss() {}
    #[inline(always)]
    pub(crate) fn cache_evictions(_: u64) {}
    #[inline(always)]
    pub(crate) fn job(_: &str, _: &'static str, _: Duration, _: Duration) {}
    #[inline(always)]
    pub(crate) fn job_ended(_: &str, _: u32) {}
    #[inline(always)]
    pub(crate) fn job_depth(_: &[super::KindDepth]) {}
}

pub(crate) use record::*;

/// One kind's depth, summed over its keys, for the `freshlock_job_depth` gauge.
#[derive(Clone, Debug, Default)]
pub(crate) struct KindDepth {
    pub(crate) kind: String,
    pub(crate) waiting: u64,
    pub(crate) due: u64,
    pub(crate) failed: u64,
    /// Waiting jobs of a kind that no running worker takes.
    pub(crate) no_worker: u64,
}
