//! A held attempt's completion, deferred to its `COMMIT`'s message (`flights/`): what the job
//! step records (`record.rs`) and the held attempt sends and reads back.

use super::{job::JobId, store};

/// The completion a held attempt sends in its `COMMIT`'s message (`flights/`).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(super) struct Deferred {
    /// The statement, not sent.
    pub(super) completion: store::Completion,
    /// The jobs it marks done.
    pub(super) ids: Vec<JobId>,
    /// Whether a marker's INSERT rides in the message (the evidence is a marker no statement
    /// wrote yet).
    pub(super) rides: bool,
    /// The key the worker follows when the completion readied its next job.
    pub(super) follow: Option<Vec<u8>>,
    /// A leased job's finish: what its promotion may claim (the claimed job is read from the
    /// completion's reply).
    pub(super) chaining: Option<Chaining>,
}

/// What a finish's promotion may claim: the new claim's owner token, and the kinds (see
/// `JobStep::chaining`).
pub(super) type Chaining = (String, Vec<store::Claimable>);
