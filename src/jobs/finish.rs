//! A leased job's finish: fenced by its claim, its kind's finish run in the job's transaction.

use sea_orm::DatabaseTransaction;
use tracing::warn;

use super::{
    JobFailure, JobOutcome, JobRun,
    job::Raw,
    kinds::Kind,
    leased::Finishing,
    retry::decide,
    step::{Did, Ended, Failed, JobStep, Measured, Ran, Start, waited},
    store,
};
use crate::db::deadline::Bounded;

impl JobStep<'_> {
    /// Finishes a leased job whose work ended, if its claim still holds: runs its finish (when
    /// the work succeeded) in the transaction. Owns the transaction as [`take`](Self::take).
    pub(super) async fn finish(
        &mut self,
        txn: DatabaseTransaction,
        finishing: &Finishing,
    ) -> (DatabaseTransaction, std::result::Result<Did, Failed>) {
        let claim = &finishing.claim;
        let kind_name = claim.kind_name();
        let bounded = Bounded::new(&txn, self.cx.reply());
        let held = store::hold(&bounded, claim.id, &claim.owner).await;
        let held = match held {
            Ok(held) => held,
            Err(e) => return (txn, Err(("checking the claim on a job of", e))),
        };
        if !held {
            let outcome = match store::is_cancelled(&bounded, claim.id).await {
                Ok(true) => JobOutcome::Cancelled,
                Ok(false) => {
                    warn!("the job's lease expired and was taken over: its finish is refused");
                    JobOutcome::LeaseLost
                }
                Err(e) => return (txn, Err(("checking the claim on a job of", e))),
            };
            self.measured.push(Measured {
                kind: kind_name.clone(),
                outcome: outcome.name(),
                waited: waited(claim.waited),
                ran: finishing.ran,
                ended_on: None,
            });
            let runs = vec![JobRun {
                id: claim.id,
                kind: kind_name,
                attempt: claim.attempt,
                outcome,
            }];
            return (txn, Ok(Did::Nothing(runs)));
        }
        let started = tokio::time::Instant::now();
        let kind = self.cx.kind(&claim.kind);
        let leased = kind.as_deref().and_then(Kind::leased);
        let (txn, (outcome, effects)) = match (&finishing.worked, kind.as_deref(), leased) {
            (Ok(output), Some(kind), Some(_)) => {
                let raw = Raw {
                    id: claim.id,
                    attempt: claim.attempt,
                    key: claim.key_text(),
                    payload: &claim.payload,
                };
                let start = Start::Finish(raw, output);
                let (txn, ran) = self
                    .attempt(txn, kind, &kind_name, claim.id, claim.attempt, start)
                    .await;
                match ran {
                    Ok(Ran::Ended(outcome, effects)) => (txn, (outcome, effects)),
                    Ok(Ran::Spoiled) => return (txn, Ok(Did::Spoiled)),
                    Err(failed) => return (txn, Err(failed)),
                }
            }
            (Err((failure, retries)), _, Some((_, policy))) => {
                let outcome = decide(policy, claim.id, claim.attempt, failure.clone(), *retries);
                (txn, (outcome, Vec::new()))
            }
            // The work could not start (its kind is not leased here): fails at once.
            (Err((failure, _)), _, None) => {
                (txn, (JobOutcome::Failed(failure.clone()), Vec::new()))
            }
            (Ok(_), _, _) => {
                let failure = JobFailure::UnknownKind {
                    kind: kind_name.clone(),
                };
                (txn, (JobOutcome::Failed(failure), Vec::new()))
            }
        };
        let ended = Ended {
            id: claim.id,
            kind: kind_name,
            key: claim.key.clone(),
            attempt: claim.attempt,
            waited: claim.waited,
            outcome,
            effects,
            ran: finishing.ran + started.elapsed(),
            span: None,
        };
        (txn, Ok(Did::Ended(vec![ended])))
    }
}
