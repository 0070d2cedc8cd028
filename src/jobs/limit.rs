//! Limits on a kind's jobs ([`Limit`]): how many run at once, how many start per period — per
//! kind, or per key. The take enforces them (`admit.rs`) without ever making a worker wait.

use std::time::Duration;

use super::store::{self, Tokens};
use crate::lock::sql::millis;

/// A limit on the jobs of one kind, across every worker and process that shares the job table
/// ([`Jobs::limit`](super::Jobs::limit)). A job over its kind's limit **stays waiting** and the
/// worker takes another kind's job (or another key's) instead: no worker ever waits for a
/// limit, and no limit is ever exceeded — a limit's tokens are rows of
/// `freshlock_job_slot` ([`crate::schema::JobSlotMigration`]) that a take locks with `SKIP
/// LOCKED` in the transaction that runs (or claims) the job.
///
/// - [`Limit::running`]: at most `n` jobs of the kind running at once. A job that runs in its
///   transaction holds one token until that transaction ends; a leased kind's jobs
///   ([`Jobs::handle_leased`](super::Jobs::handle_leased)) are counted while their lease lives.
///   `Limit::running(0)` pauses the kind.
/// - [`Limit::rate`]: at most `jobs` jobs of the kind *started* in any period of length `per`
///   (a sliding window: each token is used again a period after its use at the earliest).
/// - [`Limit::rate_per_key`]: the same for each job key on its own (jobs without a key share one
///   count): one account's burst is spread out while every other account's jobs run at once.
///
/// There is no "running per key": the jobs of one key already run one at a time
/// ([`NewJob::key`](super::NewJob::key)). A job whose transaction rolls back gives its tokens
/// back; an attempt that failed keeps the rate's token it used. Declare the same limits in every
/// worker that takes the kind: each enforces the limit it was given.
///
/// ```
/// use std::time::Duration;
/// use freshlock::{ApplyError, Tx, jobs::{Job, Jobs, Limit, RetryPolicy}};
///
/// async fn charge(_tx: &Tx, _job: Job<i64>) -> Result<(), ApplyError> {
///     Ok(())
/// }
///
/// let jobs = Jobs::new()
///     .handle("charge", RetryPolicy::default(), charge)
///     // The payment provider takes 4 calls at once, 100 a second, 5 a second per account.
///     .limit("charge", Limit::running(4))
///     .limit("charge", Limit::rate(100, Duration::from_secs(1)))
///     .limit("charge", Limit::rate_per_key(5, Duration::from_secs(1)));
/// # let _ = jobs;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit(pub(super) Bound);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Bound {
    Running(u32),
    Rate {
        jobs: u32,
        per: Duration,
        per_key: bool,
    },
}

impl Limit {
    /// At most `n` jobs of the kind running at once (`0` pauses the kind).
    pub fn running(n: u32) -> Self {
        Self(Bound::Running(n))
    }

    /// At most `jobs` jobs of the kind started in any period of length `per`.
    pub fn rate(jobs: u32, per: Duration) -> Self {
        Self(Bound::Rate {
            jobs,
            per,
            per_key: false,
        })
    }

    /// At most `jobs` jobs of each key of the kind started in any period of length `per`.
    pub fn rate_per_key(jobs: u32, per: Duration) -> Self {
        Self(Bound::Rate {
            jobs,
            per,
            per_key: true,
        })
    }

    /// Whether `other` limits the same thing (a kind has one limit of each sort).
    pub(super) fn same_sort(&self, other: &Self) -> bool {
        match (self.0, other.0) {
            (Bound::Running(_), Bound::Running(_)) => true,
            (Bound::Rate { per_key: a, .. }, Bound::Rate { per_key: b, .. }) => a == b,
            _ => false,
        }
    }

    /// Whether the limit holds tokens for as long as a job runs (taken before the rates, which
    /// use theirs up).
    pub(super) fn held(&self) -> bool {
        matches!(self.0, Bound::Running(_))
    }

    /// The limit's scope for a job of `kind` with key `key`: the SHA-256 of what it counts.
    pub(super) fn scope(&self, kind: &[u8], key: Option<&[u8]>) -> Vec<u8> {
        let (tag, key) = match self.0 {
            Bound::Running(_) => (b'r', None),
            Bound::Rate { per_key: false, .. } => (b't', None),
            Bound::Rate { per_key: true, .. } => (b'k', key),
        };
        let mut named = Vec::with_capacity(kind.len() + key.map_or(0, <[u8]>::len) + 10);
        named.push(tag);
        named.extend((kind.len() as u64).to_be_bytes());
        named.extend(kind);
        if let Some(key) = key {
            named.push(1);
            named.extend(key);
        }
        store::hash(named)
    }

    /// Whether the limit counts each key on its own (a refusal then concerns the job's key).
    pub(super) fn per_key(&self) -> bool {
        matches!(self.0, Bound::Rate { per_key: true, .. })
    }

    /// How many tokens the limit's scope has and how they are used. A leased kind's running
    /// limit has one, its gate: claims of the kind count the live leases one at a time
    /// (`admit.rs`).
    pub(super) fn tokens(&self, leased: bool) -> (u32, Tokens) {
        match self.0 {
            Bound::Running(n) if leased => (n.min(1), Tokens::Held),
            Bound::Running(n) => (n, Tokens::Held),
            Bound::Rate { jobs, per, .. } => (jobs, Tokens::Rate(millis(per))),
        }
    }
}
