//! The job table's statements, per dialect (the table itself: `schema/job.rs`).

mod advance;
mod cancel;
mod check;
mod finish;
mod head;
mod insert;
mod lease;
mod promote;
mod slot;
mod sweep;
mod take;
mod workers;

pub(crate) use advance::advance;
pub(crate) use cancel::{Found, cancel, forget_finished, is_cancelled, look, request, requested};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use cancel::{read_requested, requested_statement};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use check::{unless_counted, unless_done};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use finish::completion;
pub(crate) use finish::{Completion, complete, failed};
pub(crate) use insert::{Insert, holder_of, insert, insert_many};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use lease::claim_statement;
pub(crate) use lease::{claim, extend, hold, reclaim};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use promote::claimed_by;
pub(crate) use promote::{Claimable, Claiming, promote, promote_claiming};
pub(crate) use slot::{Tokens, acquire, forget_unused, leased_now, make_missing};
pub(crate) use sweep::sweep;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use take::take_statement;
pub(crate) use take::{Taken, take, take_after, take_key};
pub(crate) use workers::{advertise, taken};

use sea_orm::Value;
use sha2::{Digest, Sha256};

/// Most stranded jobs one [`sweep`] readies (the next sweep readies more).
pub(super) const SWEEP_AT_MOST: u32 = 500;

/// Longest error text kept with a job, in characters.
pub(super) const MAX_ERROR: usize = 4000;

/// The SHA-256 of a key: what the indexes hold, so that a key of any length is compared byte for
/// byte through a fixed-size index entry.
pub(crate) fn hash(key: impl AsRef<[u8]>) -> Vec<u8> {
    Sha256::digest(key.as_ref()).to_vec()
}

/// A key's hash ([`hash`]) as a bound value.
pub(super) fn hashed(key: impl AsRef<[u8]>) -> Value {
    Value::Bytes(Some(hash(key)))
}

/// A text as bytes (kinds, keys and unique keys are stored as bytes), or SQL `NULL`.
pub(super) fn bytes(value: Option<&str>) -> Value {
    Value::Bytes(value.map(|v| v.as_bytes().to_vec()))
}
