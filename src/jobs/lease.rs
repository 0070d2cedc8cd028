//! Leased jobs: the field report's shape — claim under a lease, heavy work outside any
//! transaction while a heartbeat keeps the lease, finish in a transaction fenced by the claim.
//!
//! The claim commits with the take (`store::claim`): the job is `LEASED`, its key busy. The
//! work runs with no transaction and no connection held; every third of the lease a heartbeat
//! moves the expiry on (`store::extend`). The finish runs on the engine like any job: it runs
//! the kind's finish and completes the job in the same commit only under the claim (the
//! completing `UPDATE` requires the claim's owner; a finish that finds it gone rolls back and
//! reports why after a look at the claim, `store::hold`; a failed work or finish looks first),
//! and a failing finish rolls back, as any handler. In a worker's run loop the finish also
//! claims the key's next job when it is leased (`store::Claiming`): a hot key's
//! leased jobs cost one transaction each, and this task runs the next one's work at once.
//! A worker that stops, hangs or loses the database lets its lease expire; any worker then makes the job wait again (`store::reclaim`,
//! at most once a second per worker) and it runs again — a late finish of the old claim is
//! refused ([`JobOutcome::LeaseLost`]) and rolled back, so the effects committed are those of
//! one attempt. What the work does outside the database runs at least once per attempt.

use tokio::{sync::watch, time::MissedTickBehavior};
use tracing::{Instrument, info_span, warn};

use super::{
    catch::{CatchUnwind, panic_message},
    context::Context,
    job::{JobFailure, JobRun, Raw},
    leased::{Claimed, Finishing, Lease, Output},
    retry::Retry,
    run::run_step,
    step::Source,
    store,
};
use crate::{db::deadline::within, error::Result};

/// Runs claimed jobs' work, then their finishes: one after another for one job, side by side
/// (a task each) for several. With `chain`, each goes on with the next jobs of its key that its
/// finishes claim.
pub(super) async fn run_all(
    cx: &Context,
    claimed: Vec<Claimed>,
    chain: bool,
) -> Result<Vec<JobRun>> {
    if claimed.len() <= 1 {
        let mut runs = Vec::new();
        for claim in claimed {
            runs.extend(run(cx, claim, chain).await?);
        }
        return Ok(runs);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for claim in claimed {
        let cx = cx.clone();
        tasks.spawn(async move { run(&cx, claim, chain).await });
    }
    let mut runs = Vec::new();
    let mut failed = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(ran)) => runs.extend(ran),
            Ok(Err(error)) => failed = failed.or(Some(error)),
            // A finish is never cut short by a panic (handlers' panics are caught); a task can
            // only end so with the runtime shutting down. The job's lease expires.
            Err(error) => warn!(%error, "a leased job's task ended early"),
        }
    }
    match failed {
        Some(error) => Err(error),
        None => {
            runs.sort_by_key(|run| run.id);
            Ok(runs)
        }
    }
}

/// Works claimed job `claim` with a heartbeat, then finishes it; and so on with the next job
/// of its key while each finish claims it (`store::Claiming`): their runs, in order.
async fn run(cx: &Context, claim: Claimed, chain: bool) -> Result<Vec<JobRun>> {
    let mut runs = Vec::new();
    let mut next = Some(claim);
    while let Some(claim) = next {
        let (run, claimed) = run_one(cx, claim, chain).await?;
        runs.push(run);
        next = claimed;
    }
    Ok(runs)
}

/// Works claimed job `claim` with a heartbeat, then finishes it: its run, and the job its
/// finish claimed next.
async fn run_one(cx: &Context, claim: Claimed, chain: bool) -> Result<(JobRun, Option<Claimed>)> {
    let kind = claim.kind_name();
    let span = info_span!("freshlock.job", id = claim.id, kind = %kind, attempt = claim.attempt, outcome = tracing::field::Empty);
    let started = tokio::time::Instant::now();
    let worked = work(cx, &claim).instrument(span.clone()).await;
    let finishing = Finishing {
        claim,
        worked,
        ran: started.elapsed(),
        chain,
    };
    let stepped = run_step(cx, Source::Finish(&finishing))
        .instrument(span.clone())
        .await?;
    let run = stepped.runs;
    // The finish always reports its job; this only guards that.
    let run = run.into_iter().next().ok_or_else(|| {
        let missing = sea_orm::DbErr::Custom("the finish reported no job".to_owned());
        crate::error::database(
            "finishing a leased job of",
            &crate::schema::JOB_TABLE,
            missing,
        )
    })?;
    span.record("outcome", run.outcome.name());
    Ok((run, stepped.claimed.into_iter().next()))
}

/// Runs `claim`'s work, beating its heartbeat every third of the lease.
async fn work(cx: &Context, claim: &Claimed) -> std::result::Result<Output, (JobFailure, Retry)> {
    let kind = cx.kind(&claim.kind);
    let Some((leased, policy)) = kind.as_ref().and_then(|k| k.leased()) else {
        let failure = JobFailure::UnknownKind {
            kind: claim.kind_name(),
        };
        return Err((failure, Retry::Never));
    };
    let (lost_tx, lost_rx) = watch::channel(false);
    let lease = Lease {
        id: claim.id,
        lost: lost_rx,
    };
    let raw = Raw {
        id: claim.id,
        attempt: claim.attempt,
        key: claim.key_text(),
        payload: &claim.payload,
    };
    let future = match (leased.work)(raw, lease) {
        Ok(future) => future,
        Err(reason) => {
            let failure = JobFailure::BadPayload {
                kind: claim.kind_name(),
                reason,
            };
            return Err((failure, Retry::Never));
        }
    };
    let mut future = CatchUnwind::new(future);
    let period = claim.lease / 3;
    let mut beat = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut held = true;
    let ended = loop {
        tokio::select! {
            ended = &mut future => break ended,
            _ = beat.tick(), if held => {
                let db = crate::db::autocommit::autocommit(cx.session.pool());
                let extended = store::extend(&db, claim.id, &claim.owner, claim.lease);
                match within(cx.reply(), extended).await {
                    Ok(true) => {}
                    Ok(false) => {
                        held = false;
                        let _ = lost_tx.send(true);
                        warn!("the job's lease was lost: another worker runs it now");
                    }
                    Err(error) => {
                        warn!(%error, "extending a job's lease failed; the next beat tries again");
                    }
                }
            }
        }
    };
    match ended {
        Ok(Ok(output)) => Ok(output),
        Ok(Err(error)) => {
            let retries = policy.retries(&error);
            Err((JobFailure::Handler(error.to_string()), retries))
        }
        Err(panic) => Err((JobFailure::Panicked(panic_message(&*panic)), Retry::Allowed)),
    }
}
