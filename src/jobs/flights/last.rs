//! A held attempt's last message: its statements and `COMMIT` as one message — and after them,
//! in a worker's loop, the next attempt's `BEGIN` and take (`pretake.rs`) — and what follows
//! when it did not answer as sent: a check that stopped it, a reply lost (resolved by the
//! commit's evidence on another connection); and the `ROLLBACK` of an attempt that keeps
//! nothing.

use sea_orm::DbErr;
use tracing::warn;

use super::{Committed, check::stopped, pretake};
use crate::{
    commit::{Evidence, Resolution},
    db::{
        deadline::within,
        failure::{in_doubt, is_cardinality_violation},
        held::Held,
        pinned::Reply,
    },
    error::{Result, database},
    jobs::{job::JobId, step::JobStep},
    schema::JOB_TABLE,
};

/// How [`end`] ended, when it did not fail.
pub(super) enum Ended {
    /// Committed: the replies of the message's statements.
    Committed(Vec<Reply>),
    /// Committed, known from the evidence after the reply was lost: no statement's reply.
    Resolved,
    /// The check stopped the message (see [`stopped`]).
    Stopped,
}

/// Sends `statements` and `COMMIT` as one message, then `ahead`'s statements (which begin the
/// next attempt's transaction: `step.ahead`, when they all answered); `checked`: the jobs whose
/// check is among them. A lost reply is resolved with `evidence`.
pub(super) async fn end(
    step: &mut JobStep<'_>,
    held: Held,
    checked: Option<&[JobId]>,
    mut statements: Vec<String>,
    evidence: Option<&Evidence>,
    ahead: Option<pretake::Ahead>,
) -> Result<Ended> {
    let reply = step.cx.reply();
    // A finish that sent nothing yet: its whole transaction is this message. Then the
    // statements left to ride (a claim's UPDATE), whose replies nobody reads.
    let mut first: Vec<String> = held.unbegun().map(str::to_owned).into_iter().collect();
    let skip = first.first().map_or(0, |begin| begin.split(';').count());
    let riders = held.riders();
    let skip = skip + riders.len();
    first.extend(riders);
    // The replies up to the `COMMIT`'s.
    let committed = skip + statements.len() + 1;
    statements.splice(0..0, first);
    statements.push("COMMIT".to_owned());
    statements.extend(ahead.iter().flat_map(|ahead| ahead.statements()).cloned());
    let sent = within(reply, held.last(&statements, committed)).await;
    let e = match sent {
        Ok(mut replies) => {
            let after = replies.split_off(committed.min(replies.len()));
            step.ahead = pretake::carried(held, ahead, after);
            replies.drain(..skip.min(replies.len()));
            return Ok(Ended::Committed(replies));
        }
        Err(e) => e,
    };
    match checked {
        Some(ids) if is_cardinality_violation(&e) => stopped(step, held, ids, reply)
            .await
            .map(|_| Ended::Stopped),
        _ if in_doubt(&e) => {
            // Closed first: the server ends the transaction if the COMMIT never came.
            drop(held);
            let resolved = resolve(step, evidence, e).await;
            resolved.map(|_| Ended::Resolved)
        }
        _ => Err(database("completing jobs in", &JOB_TABLE, e)),
    }
}

/// A lost reply of the last message, resolved with `evidence` on another connection.
async fn resolve(
    step: &JobStep<'_>,
    evidence: Option<&Evidence>,
    lost: DbErr,
) -> Result<Committed> {
    warn!(error = %lost, "the commit's reply was lost: resolving on another connection");
    let db = step.cx.session.pool();
    let Some(evidence) = evidence else {
        return Err(crate::commit::write_error("committing", JOB_TABLE, lost));
    };
    match evidence.resolve(db, JOB_TABLE, step.cx.reply()).await? {
        Resolution::Committed => Ok(Committed::Yes),
        // The lost connection, as it is: transient, so the attempt runs again.
        Resolution::Absent => Err(database("committing", &JOB_TABLE, lost)),
    }
}

/// Rolls back a held transaction that was begun (the connection is closed instead when that
/// fails), and gives the connection back.
pub(super) async fn roll_back(held: Held, reply: std::time::Duration) {
    if !held.begun() {
        held.release();
        return;
    }
    // Closed instead when the ROLLBACK fails (the server ends the transaction).
    if within(reply, held.conn().flight("ROLLBACK".to_owned()))
        .await
        .is_ok()
    {
        held.release();
    }
}
