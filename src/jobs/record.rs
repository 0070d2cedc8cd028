//! How the attempt's jobs ended, recorded in its transaction: failures and retries, the next
//! job of each finished key readied, and the completion with the commit's evidence.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, DbErr};

use super::{
    deferred::Chaining,
    job::{JobId, JobOutcome, JobRun},
    step::{Ended, Failed, JobStep, Measured, Source, waited},
    store,
};
use crate::{
    commit::{Evidence, Marker, Plan},
    db::{deadline::Bounded, txn::Txn},
    lock::holder::new_token,
    write::engine::{Fence, Tried, Worked},
};

impl<'w> JobStep<'w> {
    /// Records in `txn` how the `ended` jobs' attempts ended, readies the next job of each key
    /// that finished, and marks the completed ones done (with the commit's evidence when that
    /// statement can take it).
    pub(super) async fn record(
        &mut self,
        txn: &Txn,
        ended: Vec<Ended>,
    ) -> std::result::Result<Worked<Vec<JobRun>>, Failed> {
        let txn = &Bounded::new(txn, self.cx.reply());
        let mut runs = Vec::with_capacity(ended.len());
        let mut all_effects = Vec::new();
        let mut completed = Vec::new();
        let mut finished_keys = Vec::new();
        // A job asked to stop ([`crate::jobs::cancel`]) whose attempt failed is cancelled
        // instead of retried (read only when an attempt failed: no round trip otherwise).
        let retrying: Vec<JobId> = (ended.iter())
            .filter(|e| matches!(e.outcome, JobOutcome::Retrying { .. }))
            .map(|e| e.id)
            .collect();
        let stop = (store::requested(txn, &retrying).await)
            .map_err(|e| ("reading the requests to stop jobs of", e))?;
        for mut ended in ended {
            if stop.contains(&ended.id) {
                (store::cancel(txn, ended.id).await).map_err(|e| ("cancelling a job of", e))?;
                ended.outcome = JobOutcome::Cancelled;
            }
            let stored_attempts = i32::try_from(ended.attempt).unwrap_or(i32::MAX);
            let recorded = match &ended.outcome {
                JobOutcome::Completed => {
                    completed.push(ended.id);
                    Ok(())
                }
                JobOutcome::Retrying { failure, after } => {
                    let error = failure.to_string();
                    store::failed(txn, ended.id, stored_attempts, &error, Some(*after)).await
                }
                JobOutcome::Failed(failure) => {
                    let error = failure.to_string();
                    store::failed(txn, ended.id, stored_attempts, &error, None).await
                }
                // Reported without recording (`Did::Nothing`), or recorded already (`cancel`).
                JobOutcome::LeaseLost | JobOutcome::Cancelled => Ok(()),
            };
            recorded.map_err(|e| ("recording how a job ended in", e))?;
            let name = ended.outcome.name();
            if let Some(span) = &ended.span {
                span.record("outcome", name);
            }
            let finished = !matches!(ended.outcome, JobOutcome::Retrying { .. });
            if let Some(key) = &ended.key {
                // A key's jobs end here in its order (a chain's, one after another): its next
                // job is readied when the last of them finished, not when it waits for a retry.
                let key = store::hash(key);
                finished_keys.retain(|k| *k != key);
                if finished {
                    finished_keys.push(key);
                }
            }
            self.measured.push(Measured {
                kind: ended.kind.clone(),
                outcome: name,
                waited: waited(ended.waited),
                ran: ended.ran,
                ended_on: finished.then_some(ended.attempt),
            });
            all_effects.extend(ended.effects);
            runs.push(JobRun {
                id: ended.id,
                kind: ended.kind,
                attempt: ended.attempt,
                outcome: ended.outcome,
            });
        }
        // The next job of each key whose job finished here may run once this commits; a
        // worker that ran one job follows its key (see `Source::Take`), a leased job's finish
        // in a worker's loop claims it in the same statement when it is leased too
        // (`store::Claiming`).
        let single = match (&self.source, finished_keys.as_slice()) {
            (Source::Take { limit: 1, .. } | Source::Finish(_), [key]) => Some(key.clone()),
            _ => None,
        };
        let chaining = match &self.source {
            Source::Finish(finishing) if finishing.chain && single.is_some() => self.chaining(),
            _ => None,
        };
        let claiming = (chaining.as_ref()).map(|(owner, kinds)| store::Claiming { owner, kinds });
        let completes = !completed.is_empty();
        let (evidence, readied, claimed) = if !completes {
            let promoted = store::promote_claiming(txn, finished_keys, &[], claiming.as_ref());
            let (readied, claimed) =
                (promoted.await).map_err(|e| ("readying the next jobs of", e))?;
            (None, readied, claimed)
        } else {
            match self
                .complete(txn, &completed, finished_keys, claiming.as_ref())
                .await?
            {
                Some(done) => done,
                // Asked to stop while they ran: roll back; the next attempt cancels them.
                None => return Ok(Worked::Undone(Tried::Uncounted)),
            }
        };
        match self.deferred.as_mut() {
            // The completion is sent with the `COMMIT` (`flights/`), which follows the key
            // when it readied its next job, and takes the job it claimed.
            Some(deferred) if completes => {
                deferred.follow = single;
                deferred.chaining = chaining;
            }
            _ => {
                self.claim_next(claimed, chaining);
                if single.is_some() {
                    self.follow = single.filter(|_| readied == 1);
                }
            }
        }
        Ok(Worked::Write {
            value: runs,
            evidence,
            fence: Fence::Unchecked,
            effects: all_effects,
        })
    }

    /// Marks the `completed` jobs done and readies the next job of each key in `promote` (see
    /// `store::complete`): the commit's evidence when the statement took it (on PostgreSQL with
    /// `freshlock_incarnation`, by returning the transaction's id: no round trip of its own),
    /// `None` for the engine to take at the commit; and how many jobs it readied. `None` when
    /// some of the jobs were asked to stop ([`crate::jobs::cancel`]): they are left in
    /// `self.cancelling` for the next attempt, and this one must roll back.
    pub(super) async fn complete(
        &mut self,
        txn: &Bounded<'_, Txn>,
        completed: &[JobId],
        promote: Vec<Vec<u8>>,
        claiming: Option<&store::Claiming<'_>>,
    ) -> std::result::Result<Option<Completed>, Failed> {
        const OPERATION: &str = "completing jobs in";
        // A held attempt sends the completion with its `COMMIT` (`flights/`).
        #[cfg(any(feature = "postgres", feature = "mysql"))]
        if let Txn::Held(held) = txn.inner() {
            return self.defer(held, txn, completed, promote, claiming).await;
        }
        let db = self.cx.session.pool();
        let markers = self.cx.session.commit_markers();
        let plan = match markers {
            true => Plan::of(db, txn).await,
            false => Plan::Marker,
        };
        let stamped = match plan {
            Plan::Stamped(stamped) => Some(stamped),
            // A marker (or nothing) is taken by the engine at the commit.
            _ => None,
        };
        let stamps = stamped.as_ref().map(|s| s.exprs());
        // On MySQL/MariaDB the marker rides in the completion's message (one round trip less
        // than the engine's INSERT before `COMMIT`); elsewhere the engine takes it.
        let backend = txn.get_database_backend();
        let marker =
            (backend == DbBackend::MySql && stamped.is_none() && markers).then(Marker::new);
        let owner = self.owner();
        let completion = store::complete(
            txn,
            completed,
            stamps,
            promote,
            owner,
            marker.as_ref(),
            claiming,
        );
        let done = (completion.await).map_err(|e| (OPERATION, e))?;
        if done.done < completed.len() as u64 {
            if owner.is_some() {
                // The claim is gone: roll back; the next attempt looks at it first and says why.
                self.recheck = true;
                return Ok(None);
            }
            self.cancelling = (store::requested(txn, completed).await)
                .map_err(|e| ("reading the requests to stop jobs of", e))?;
            return Ok(None);
        }
        let Some(stamped) = stamped else {
            return Ok(Some((
                marker.map(Evidence::Marker),
                done.readied,
                done.claimed,
            )));
        };
        let row = (done.row)
            .ok_or_else(|| (OPERATION, DbErr::RecordNotFound("a job to complete".into())))?;
        (stamped.evidence(txn, db, &row).await)
            .map(|evidence| Some((Some(evidence), done.readied, done.claimed)))
            .map_err(|e| ("marking the commit of", e))
    }

    /// [`complete`](Self::complete) in a held attempt: the commit's evidence — the transaction's
    /// id read with `BEGIN`, or a marker that rides in the `COMMIT`'s message — and the
    /// completion's statement, left in `self.deferred` for `flights/` to send with the
    /// `COMMIT` (what it readies is read from its reply there).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    async fn defer(
        &mut self,
        held: &crate::db::held::Held,
        txn: &Bounded<'_, Txn>,
        completed: &[JobId],
        promote: Vec<Vec<u8>>,
        claiming: Option<&store::Claiming<'_>>,
    ) -> std::result::Result<Option<Completed>, Failed> {
        const OPERATION: &str = "completing jobs in";
        let (evidence, rides) =
            (self.held_evidence(held).await).map_err(|e| ("marking the commit of", e))?;
        let owner = self.owner();
        let completion = store::completion(txn, completed, None, promote, owner, claiming);
        let completion = completion.await.map_err(|e| (OPERATION, e))?;
        self.deferred = Some(super::deferred::Deferred {
            completion,
            ids: completed.to_vec(),
            rides,
            follow: None,
            chaining: None,
        });
        Ok(Some((evidence, 0, None)))
    }

    /// A held attempt's commit evidence, known before its last message leaves (`self.plan`'s):
    /// the transaction's id read with `BEGIN` (PostgreSQL, once something was sent), or a new
    /// marker whose INSERT is to ride in the last message (`true`): elsewhere, and on PostgreSQL
    /// when nothing was sent yet — the last message is then the transaction's only one.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(super) async fn held_evidence(
        &mut self,
        held: &crate::db::held::Held,
    ) -> std::result::Result<(Option<Evidence>, bool), DbErr> {
        match self.plan.take() {
            // Nothing sent yet (a leased finish whose finish sent nothing): a marker that rides
            // in the transaction's only message, not a round trip of its own for the id.
            Some(Plan::Stamped(_)) if !held.begun() => {
                Ok((Some(Evidence::Marker(Marker::new())), true))
            }
            Some(Plan::Stamped(stamped)) => {
                let reply = self.cx.reply();
                crate::db::deadline::within(reply, held.begun_before()).await?;
                let read = held.read_with_begin().into_iter().next();
                let row = read.and_then(|reply| reply.rows.into_iter().next());
                let row = row.ok_or_else(|| {
                    DbErr::RecordNotFound("the transaction's id read with BEGIN".into())
                })?;
                let db = self.cx.session.pool();
                let evidence = stamped.evidence(held, db, &row);
                let evidence = crate::db::deadline::within(reply, evidence).await?;
                Ok((Some(evidence), false))
            }
            Some(Plan::Marker) => Ok((Some(Evidence::Marker(Marker::new())), true)),
            None => Ok((None, false)),
        }
    }

    /// The claim a leased job's finish completes its job under (see `finish.rs`): the
    /// completion requires it.
    pub(super) fn owner(&self) -> Option<&'w str> {
        match self.source {
            Source::Finish(finishing) => Some(finishing.claim.owner.as_str()),
            Source::Take { .. } => None,
        }
    }

    /// Takes `claimed`, the job a finish's promotion claimed under `chaining`'s owner: its
    /// work runs once the transaction commits.
    pub(super) fn claim_next(&mut self, claimed: Option<store::Taken>, chaining: Option<Chaining>) {
        if let (Some(taken), Some((owner, kinds))) = (claimed, chaining) {
            let lease = (kinds.iter()).find(|claimable| claimable.kind == taken.kind);
            let lease = lease.map_or(Duration::ZERO, |claimable| claimable.lease);
            let attempt = u32::try_from(taken.attempts).unwrap_or(0).saturating_add(1);
            self.claimed_as(taken, attempt, owner, lease);
        }
    }

    /// What a leased job's finish may claim of its key's next job (see `store::Claiming`): a
    /// new owner token, and the leased kinds this worker runs without limits (a limited kind's
    /// job goes through a take's admission), each with its attempts and lease. `None` when it
    /// runs none.
    fn chaining(&self) -> Option<Chaining> {
        let kinds: Vec<_> = (self.cx.kinds().iter())
            .filter(|kind| self.cx.limits(kind).is_empty())
            .filter_map(|name| {
                let kind = self.cx.kind(name)?;
                let (leased, policy) = kind.leased()?;
                Some(store::Claimable {
                    kind: name.clone(),
                    attempts: policy.max_attempts,
                    lease: leased.lease,
                })
            })
            .collect();
        (!kinds.is_empty()).then(|| (new_token(), kinds))
    }
}

/// What recording a completion gives: its commit's evidence (when its statement took it), how
/// many jobs it readied, and the job its promotion claimed.
type Completed = (Option<Evidence>, u64, Option<store::Taken>);
