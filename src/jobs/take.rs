//! The take: due jobs locked by one statement, those of in-transaction kinds run, those of
//! leased kinds claimed; a keyed job's key followed by its next jobs (a chain).

use super::{
    admit,
    job::{JobFailure, JobOutcome, Raw},
    kinds::Runs,
    leased::Claimed,
    step::{Did, Ended, Failed, JobStep, Ran, Start},
    store,
};
use crate::{
    db::{deadline::Bounded, txn::Txn},
    lock::holder::new_token,
};

use tracing::{Instrument, info_span, warn};

/// The most jobs of one key a transaction runs one after another (`Source::Take`'s `chain`).
pub(super) const CHAIN_JOBS: usize = 16;
/// How long a chain may grow: no job of a key is chained into a transaction older than this.
pub(super) const CHAIN_FOR: std::time::Duration = std::time::Duration::from_millis(100);
/// How many times one take looks for jobs when every job it found was over a limit (each look
/// passes over the kinds and keys refused before it).
const TAKE_ROUNDS: usize = 3;

impl JobStep<'_> {
    /// Takes due jobs and runs those of in-transaction kinds; claims those of leased kinds.
    /// Owns the attempt's transaction while it runs (a handler without a savepoint gets it
    /// itself) and hands it back.
    pub(super) async fn take(
        &mut self,
        mut txn: Txn,
        limit: u32,
        follow: Option<&[u8]>,
        chain: bool,
    ) -> (Txn, std::result::Result<Did, Failed>) {
        let began = tokio::time::Instant::now();
        let reply = self.cx.reply();
        let fail = |e| ("taking jobs from", e);
        // A chain (see `Source::Take`): the key's next jobs, locked at once by one statement
        // when the take saw a job of the key queued behind the one it took — before that one
        // runs, while the connection is warm (a round trip after a job's idle time costs about
        // double), and left queued if that job fails.
        let chains = chain && limit == 1;
        let bounded = Bounded::new(&txn, reply);
        let mut kinds = std::borrow::Cow::Borrowed(self.cx.kinds());
        let mut skip_keys = Vec::new();
        let mut taken = Vec::new();
        for round in 0..TAKE_ROUNDS {
            let mut found = Ok(Vec::new());
            if let Some(key) = follow.filter(|_| limit == 1 && round == 0) {
                found = store::take_key(&bounded, &kinds, key, chains).await;
            }
            if matches!(&found, Ok(found) if found.is_empty()) {
                found = store::take(&bounded, &kinds, limit, chains, &skip_keys).await;
            }
            taken = match found {
                Ok(found) if found.is_empty() => break,
                Ok(found) => found,
                Err(e) => return (txn, Err(fail(e))),
            };
            // Jobs over a limit stay waiting (`admit.rs`); when none is left the take looks
            // again, passing over the kinds and keys at their limits, instead of waiting.
            let refused = match admit::admit(&bounded, self.cx, &mut taken).await {
                Ok(refused) => refused,
                Err(e) => return (txn, Err(("taking the limits' tokens for", e))),
            };
            if !taken.is_empty() || refused.is_empty() {
                break;
            }
            kinds.to_mut().retain(|kind| !refused.kinds.contains(kind));
            skip_keys.extend(refused.keys);
        }
        if taken.is_empty() {
            return (txn, Ok(Did::Nothing(Vec::new())));
        }
        // A batch runs its jobs in one order shared by every worker — kind, key, payload — not
        // in the order it took them: handlers whose writes are named by the job (a row per key
        // or per payload) then lock rows in one global order, and two batches that share rows
        // wait for each other instead of deadlocking (W2 with batches of 32 on 100 rows: see
        // BENCHMARKS). The jobs commit together, and a batch holds at most one job per key, so
        // no order a user can see changes.
        taken.sort_by(|a, b| (&a.kind, &a.key, &a.payload).cmp(&(&b.kind, &b.key, &b.payload)));
        let mut ended = Vec::with_capacity(taken.len());
        let mut ahead = std::collections::VecDeque::new();
        if let [first] = taken.as_slice()
            && first.followed
            && let Some(key) = first.key.as_ref().map(store::hash)
            && self.chains(&first.kind)
        {
            let more = u32::try_from(CHAIN_JOBS - 1).unwrap_or(1);
            ahead = match store::take_after(&bounded, &kinds, &key, first.id, more).await {
                Ok(next) => next.into(),
                Err(e) => return (txn, Err(fail(e))),
            };
        }
        loop {
            let (back, ran) = self
                .run_taken(txn, std::mem::take(&mut taken), &mut ended)
                .await;
            txn = back;
            match ran {
                Ok(None) => {}
                Ok(Some(spoiled)) => return (txn, Ok(spoiled)),
                Err(failed) => return (txn, Err(failed)),
            }
            // The chain goes on while its jobs complete, the transaction is young and no job
            // was claimed.
            let room = ended.len() < CHAIN_JOBS && began.elapsed() < CHAIN_FOR;
            let goes_on =
                matches!(ended.last(), Some(last) if last.outcome == JobOutcome::Completed);
            if !(room && goes_on && self.claimed.is_empty()) {
                break;
            }
            let Some(next) = ahead.pop_front() else {
                break;
            };
            if !self.chains(&next.kind) {
                break;
            }
            taken = vec![next];
        }
        (txn, Ok(Did::Ended(ended)))
    }

    /// Claims `taken` (its row locked by this transaction) for `attempt` under a lease of
    /// `lease`: its work runs once the transaction commits (`self.claimed`). In a held attempt
    /// the claim's UPDATE rides in the `COMMIT`'s message (`jobs/flights/`).
    pub(super) async fn claim(
        &mut self,
        db: &Bounded<'_, Txn>,
        taken: store::Taken,
        attempt: u32,
        lease: std::time::Duration,
    ) -> std::result::Result<(), sea_orm::DbErr> {
        let owner = new_token();
        let attempts = i32::try_from(attempt).unwrap_or(i32::MAX);
        #[cfg(any(feature = "postgres", feature = "mysql"))]
        if let Txn::Held(held) = db.inner() {
            let backend = sea_orm::ConnectionTrait::get_database_backend(&**held);
            let claim = store::claim_statement(backend, taken.id, attempts, &owner, lease);
            if held.ride(&claim) {
                self.claimed_as(taken, attempt, owner, lease);
                return Ok(());
            }
        }
        store::claim(db, taken.id, attempts, &owner, lease).await?;
        self.claimed_as(taken, attempt, owner, lease);
        Ok(())
    }

    /// `taken`, claimed by `owner` for `attempt` under a lease of `lease` (by [`Self::claim`],
    /// or by the promotion of a finish: `store::Claiming`): its work runs once the transaction
    /// commits.
    pub(super) fn claimed_as(
        &mut self,
        taken: store::Taken,
        attempt: u32,
        owner: String,
        lease: std::time::Duration,
    ) {
        self.claimed.push(Claimed {
            id: taken.id,
            kind: taken.kind,
            key: taken.key,
            payload: taken.payload,
            attempt,
            owner,
            lease,
            waited: taken.waited,
        });
    }

    /// Whether a job of `kind` may run in a chain. A leased kind's job is claimed by a take of
    /// its own, once the key's promotion made it ready; a limited kind's job takes its tokens
    /// in a take of its own: a chain runs in-transaction kinds without limits only.
    fn chains(&self, kind: &[u8]) -> bool {
        !self.cx.is_leased(kind) && self.cx.limits(kind).is_empty()
    }

    /// Runs the `taken` jobs of in-transaction kinds in `txn` and claims those of leased kinds,
    /// adding how each ended to `ended`: `Some(Did::Spoiled)` when a handler spoiled `txn`.
    pub(super) async fn run_taken(
        &mut self,
        txn: Txn,
        taken: Vec<store::Taken>,
        ended: &mut Vec<Ended>,
    ) -> (Txn, std::result::Result<Option<Did>, Failed>) {
        let mut txn = txn;
        let reply = self.cx.reply();
        for taken in taken {
            let mut attempt = u32::try_from(taken.attempts).unwrap_or(0).saturating_add(1);
            let kind_name = String::from_utf8_lossy(&taken.kind).into_owned();
            let span = info_span!("freshlock.job", id = taken.id, kind = %kind_name, attempt, outcome = tracing::field::Empty);
            let started = tokio::time::Instant::now();
            let kind = self.cx.kind(&taken.kind);
            let (outcome, effects) = match kind.as_deref() {
                None => {
                    let failure = JobFailure::UnknownKind {
                        kind: kind_name.clone(),
                    };
                    span.in_scope(|| warn!(%failure, "job failed"));
                    (JobOutcome::Failed(failure), Vec::new())
                }
                Some(kind) => match &kind.handler {
                    Runs::Leased(_) if attempt > kind.policy.max_attempts => {
                        // Only an expired lease leaves a job with its attempts used.
                        attempt -= 1;
                        let failure = JobFailure::LeaseExpired { attempts: attempt };
                        span.in_scope(|| warn!(%failure, "job failed"));
                        (JobOutcome::Failed(failure), Vec::new())
                    }
                    Runs::Leased(leased) => {
                        let bounded = Bounded::new(&txn, reply);
                        let claim = self.claim(&bounded, taken, attempt, leased.lease);
                        if let Err(e) = claim.await {
                            return (txn, Err(("claiming a job of", e)));
                        }
                        continue;
                    }
                    Runs::InTx(run) => {
                        let raw = Raw {
                            id: taken.id,
                            attempt,
                            key: (taken.key.as_ref())
                                .map(|k| String::from_utf8_lossy(k).into_owned()),
                            payload: &taken.payload,
                        };
                        let start = Start::InTx(run, raw);
                        let ran = self.attempt(txn, kind, &kind_name, taken.id, attempt, start);
                        let (back, ran) = ran.instrument(span.clone()).await;
                        txn = back;
                        match ran {
                            Ok(Ran::Ended(outcome, effects)) => (outcome, effects),
                            Ok(Ran::Spoiled) => return (txn, Ok(Some(Did::Spoiled))),
                            Err(failed) => return (txn, Err(failed)),
                        }
                    }
                },
            };
            ended.push(Ended {
                id: taken.id,
                kind: kind_name,
                key: taken.key,
                attempt,
                waited: taken.waited,
                outcome,
                effects,
                ran: started.elapsed(),
                span: Some(span),
            });
        }
        (txn, Ok(None))
    }
}
