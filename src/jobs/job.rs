//! The job words: a job as its handler gets it, how an attempt ended, and why it failed.

use std::time::Duration;

/// A job's id: its row in `freshlock_job`, growing in enqueue order.
pub type JobId = i64;

/// A job as its handler gets it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Job<P> {
    /// The job's id.
    pub id: JobId,
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// The job's serialization key, if it has one.
    pub key: Option<String>,
    /// The payload, deserialized.
    pub payload: P,
}

/// Why a job failed for good, or why an attempt failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JobFailure {
    /// No handler is registered for the job's kind (never retried). No longer produced:
    /// workers take only the kinds they have handlers for, and a kind none knows waits. Kept
    /// so that matches on it compile.
    #[error("no handler for job kind {kind:?}")]
    UnknownKind {
        /// The kind, as stored.
        kind: String,
    },
    /// The payload does not deserialize into the handler's type (never retried).
    #[error("the payload of a {kind:?} job does not deserialize: {reason}")]
    BadPayload {
        /// The kind.
        kind: String,
        /// serde's message.
        reason: String,
    },
    /// The handler returned an error.
    #[error("the handler failed: {0}")]
    Handler(String),
    /// The handler panicked.
    #[error("the handler panicked: {0}")]
    Panicked(String),
    /// A leased job's last attempt never finished: its lease expired (its worker stopped, hung
    /// or lost the database), and no attempt is left.
    #[error("the lease of attempt {attempts} (the last) expired before the job finished")]
    LeaseExpired {
        /// The attempts made.
        attempts: u32,
    },
}

/// How one job's attempt ended (committed: the job's row says so too).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum JobOutcome {
    /// The handler succeeded: its writes and the job's completion committed together.
    Completed,
    /// The attempt failed and the job runs again after `after`; its writes were rolled back.
    Retrying {
        /// Why.
        failure: JobFailure,
        /// The delay before the retry is due.
        after: Duration,
    },
    /// The job failed for good (its error is kept in its row); its writes were rolled back.
    Failed(JobFailure),
    /// A leased job's claim was gone when its work ended: its lease expired and another worker
    /// reclaimed the job, which runs (or ran) again there. This attempt's finish was refused
    /// and rolled back; what its work did outside the database is not undone.
    LeaseLost,
    /// The job was cancelled ([`cancel`](super::cancel)) while this attempt ran: its writes
    /// were rolled back (a leased job's finish was refused), and it does not run again.
    Cancelled,
}

/// One job a worker ran.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobRun {
    /// The job.
    pub id: JobId,
    /// Its kind (invalid UTF-8, which only a foreign writer can store, replaced).
    pub kind: String,
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// How it ended.
    pub outcome: JobOutcome,
}

/// A job's raw fields, for a kind's type-erased runner.
pub(super) struct Raw<'a> {
    pub(super) id: JobId,
    pub(super) attempt: u32,
    pub(super) key: Option<String>,
    pub(super) payload: &'a str,
}

impl Raw<'_> {
    /// The job with its payload deserialized as `P`, or serde's reason why it does not.
    pub(super) fn job<P: serde::de::DeserializeOwned>(self) -> Result<Job<P>, String> {
        let payload = serde_json::from_str::<P>(self.payload).map_err(|e| e.to_string())?;
        Ok(Job {
            id: self.id,
            attempt: self.attempt,
            key: self.key,
            payload,
        })
    }
}

impl JobOutcome {
    /// The outcome's name in metrics and spans.
    pub(super) fn name(&self) -> &'static str {
        match self {
            JobOutcome::Completed => "completed",
            JobOutcome::Retrying { .. } => "retrying",
            JobOutcome::Failed(_) => "failed",
            JobOutcome::LeaseLost => "lease_lost",
            JobOutcome::Cancelled => "cancelled",
        }
    }
}
