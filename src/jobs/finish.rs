//! A leased job's finish: fenced by its claim, its kind's finish run in the job's transaction.

use tracing::warn;

use super::{
    job::{JobFailure, JobOutcome, JobRun, Raw},
    kinds::Kind,
    leased::Finishing,
    retry::decide,
    step::{Did, Ended, Failed, JobStep, Measured, Ran, Start, waited},
    store,
};
use crate::db::{deadline::Bounded, txn::Txn};

impl JobStep<'_> {
    /// Finishes a leased job whose work ended, if its claim still holds: runs its finish (when
    /// the work succeeded) in the transaction. Owns the transaction as [`take`](Self::take).
    pub(super) async fn finish(
        &mut self,
        txn: Txn,
        finishing: &Finishing,
    ) -> (Txn, std::result::Result<Did, Failed>) {
        let claim = &finishing.claim;
        let kind_name = claim.kind_name();
        let bounded = Bounded::new(&txn, self.cx.reply());
        // A work that succeeded is finished without a look at the claim first: the completion
        // itself requires it (`owner`), and a finish that finds it gone rolls back and runs
        // again with this look (`JobStep::recheck`) — one round trip less per job. A failed
        // work records its failure only after the look.
        let checked = self.recheck || finishing.worked.is_err();
        if checked && let Some(unheld) = self.unheld(&bounded, finishing).await {
            return (txn, unheld);
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
        // A failure is recorded only under the claim (see above).
        if !checked && outcome != JobOutcome::Completed {
            let bounded = Bounded::new(&txn, self.cx.reply());
            match store::hold(&bounded, claim.id, &claim.owner).await {
                Ok(true) => {}
                Ok(false) => return (txn, Ok(Did::Unheld)),
                Err(e) => return (txn, Err(("checking the claim on a job of", e))),
            }
        }
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

    /// Looks at the claim of `finishing`'s job (locking its row while it holds): `None` while
    /// it holds, else what the finish reports — its lease lost, or the job cancelled.
    async fn unheld(
        &mut self,
        db: &Bounded<'_, Txn>,
        finishing: &Finishing,
    ) -> Option<std::result::Result<Did, Failed>> {
        let claim = &finishing.claim;
        match store::hold(db, claim.id, &claim.owner).await {
            Ok(true) => return None,
            Ok(false) => {}
            Err(e) => return Some(Err(("checking the claim on a job of", e))),
        }
        let outcome = match store::is_cancelled(db, claim.id).await {
            Ok(true) => JobOutcome::Cancelled,
            Ok(false) => {
                warn!("the job's lease expired and was taken over: its finish is refused");
                JobOutcome::LeaseLost
            }
            Err(e) => return Some(Err(("checking the claim on a job of", e))),
        };
        let kind = claim.kind_name();
        self.measured.push(Measured {
            kind: kind.clone(),
            outcome: outcome.name(),
            waited: waited(claim.waited),
            ran: finishing.ran,
            ended_on: None,
        });
        let runs = vec![JobRun {
            id: claim.id,
            kind,
            attempt: claim.attempt,
            outcome,
        }];
        Some(Ok(Did::Nothing(runs)))
    }
}
