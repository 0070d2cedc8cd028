//! The take's half of job limits ([`Limit`]): the tokens a taken job needs, locked with
//! `SKIP LOCKED` in the transaction that runs or claims it; a job over a limit stays waiting.

use sea_orm::{ConnectionTrait, DbErr};
use tracing::{debug, warn};

use super::{
    context::Context,
    limit::{Bound, Limit},
    store::{self, Taken},
};
use crate::db::autocommit::autocommit;

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
                    let (n, tokens) = limit.tokens(cx.is_leased(kind));
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
            let leased = cx.is_leased(kind);
            let (n, tokens) = limit.tokens(leased);
            let granted = match limit.0 {
                // A leased kind's claims count the live leases behind the gate token.
                Bound::Running(most) if leased => {
                    if store::acquire(txn, &scope, n, 1, tokens).await? == 0 {
                        0
                    } else {
                        most.saturating_sub(store::leased_now(txn, kind).await?)
                    }
                }
                _ => store::acquire(txn, &scope, n, wanted, tokens).await?,
            };
            for &i in jobs.iter().skip(granted as usize) {
                ok[i] = false;
                let job = &taken[i];
                debug!(id = job.id, limit = ?limit, "job left waiting: over its kind's limit");
                match job.key.as_deref() {
                    Some(key) if limit.per_key() => {
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
