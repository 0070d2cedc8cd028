//! Limits on a kind's jobs ([`Limit`]): how many run at once, how many start per period — per
//! kind, or per key — enforced by the take without ever making a worker wait.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbErr};
use tracing::{debug, warn};

use super::{
    context::Context,
    store::{self, Taken, Tokens},
};
use crate::{db::autocommit::autocommit, lock::sql::millis};

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
pub struct Limit(Bound);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bound {
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
    fn held(&self) -> bool {
        matches!(self.0, Bound::Running(_))
    }

    /// The limit's scope for a job of `kind` with key `key`: the SHA-256 of what it counts.
    fn scope(&self, kind: &[u8], key: Option<&[u8]>) -> Vec<u8> {
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

    /// Whether a refusal by this limit concerns the job's key only.
    fn per_key(&self, key: Option<&[u8]>) -> bool {
        matches!(self.0, Bound::Rate { per_key: true, .. }) && key.is_some()
    }
}

/// Makes the tokens of the limits of the worker's kinds that every job of a kind shares (all
/// but a per-key rate's keys), in statements of their own: so no take's transaction makes a
/// row that another take would wait for until the first job's transaction ends. Once per worker
/// (`Context`); a failure is logged and tried again by the next step.
pub(super) async fn prepare(cx: &Context) {
    let made = cx
        .limits_ready
        .get_or_try_init(|| async {
            let db = autocommit(cx.session.pool());
            for kind in cx.kinds() {
                for limit in cx.limits(kind) {
                    let (n, tokens) = match limit.0 {
                        Bound::Running(n) if cx.is_leased(kind) => (n.min(1), Tokens::Held),
                        Bound::Running(n) => (n, Tokens::Held),
                        Bound::Rate { jobs, per, .. } => (jobs, Tokens::Rate(millis(per))),
                    };
                    let scope = limit.scope(kind, None);
                    store::make_missing(&db, &scope, n, tokens).await?;
                }
            }
            Ok::<_, DbErr>(())
        })
        .await;
    if let Err(e) = made {
        warn!(error = %e, "making the tokens of job limits failed; the next take tries again");
    }
}

/// What [`admit`] refused: kinds, and key hashes, that the take passes over when it takes again.
#[derive(Debug, Default)]
pub(super) struct Refused {
    pub(super) kinds: Vec<Vec<u8>>,
    pub(super) keys: Vec<Vec<u8>>,
}

impl Refused {
    pub(super) fn is_empty(&self) -> bool {
        self.kinds.is_empty() && self.keys.is_empty()
    }
}

/// Gets the tokens the limits of the `taken` jobs ask for, in `txn` (the transaction that runs
/// or claims them), and drops from `taken` the jobs over a limit: they stay waiting, their rows
/// unchanged. Limits that hold tokens come first, then rates, so a job refused by one does not
/// use up a rate's token. Jobs without limits cost nothing.
pub(super) async fn admit(
    txn: &impl ConnectionTrait,
    cx: &Context,
    taken: &mut Vec<Taken>,
) -> Result<Refused, DbErr> {
    let mut refused = Refused::default();
    if taken.iter().all(|job| cx.limits(&job.kind).is_empty()) {
        return Ok(refused);
    }
    let mut ok = vec![true; taken.len()];
    for held in [true, false] {
        // Each scope once, with the jobs that want one of its tokens, in take order.
        let mut scopes: Vec<(Vec<u8>, Limit, Vec<usize>)> = Vec::new();
        for (i, job) in taken.iter().enumerate() {
            for limit in cx.limits(&job.kind).iter().filter(|l| l.held() == held) {
                let scope = limit.scope(&job.kind, job.key.as_deref());
                match scopes.iter_mut().find(|(s, _, _)| *s == scope) {
                    Some((_, _, jobs)) => jobs.push(i),
                    None => scopes.push((scope, *limit, vec![i])),
                }
            }
        }
        for (scope, limit, jobs) in scopes {
            let jobs: Vec<usize> = jobs.into_iter().filter(|&i| ok[i]).collect();
            let Some(&first) = jobs.first() else { continue };
            let kind = &taken[first].kind;
            let wanted = u32::try_from(jobs.len()).unwrap_or(u32::MAX);
            let granted = match limit.0 {
                Bound::Running(n) if cx.is_leased(kind) => {
                    // Claims of the kind count the live leases one at a time: the gate token.
                    if n == 0 || store::acquire(txn, &scope, 1, 1, Tokens::Held).await? == 0 {
                        0
                    } else {
                        n.saturating_sub(store::leased_now(txn, kind).await?)
                    }
                }
                Bound::Running(n) => store::acquire(txn, &scope, n, wanted, Tokens::Held).await?,
                Bound::Rate { jobs: n, per, .. } => {
                    let rate = Tokens::Rate(millis(per));
                    store::acquire(txn, &scope, n, wanted, rate).await?
                }
            };
            for &i in jobs.iter().skip(granted as usize) {
                ok[i] = false;
                let job = &taken[i];
                debug!(id = job.id, limit = ?limit, "job left waiting: over its kind's limit");
                match job.key.as_deref() {
                    Some(key) if limit.per_key(Some(key)) => {
                        refused.keys.push(store::hash(key));
                    }
                    _ => refused.kinds.push(job.kind.clone()),
                }
            }
        }
    }
    let mut i = 0;
    taken.retain(|_| {
        i += 1;
        ok[i - 1]
    });
    refused.kinds.dedup();
    Ok(refused)
}
