//! A keyed job's attempt in as few round trips as its handler allows, on a session with
//! [`crate::SessionBuilder::two_flights`]: `BEGIN` and the take as one message, the handler's
//! statements, then the completion and `COMMIT` as one message — a job whose handler sends one
//! statement is three round trips instead of five (`BEGIN`, the take, the handler's, the
//! completion, `COMMIT`), a batch of jobs two plus its handlers'. In a worker's loop the next
//! take rides in that last message, after the `COMMIT`, and the step goes on with it
//! (`pretake.rs`): two round trips a job, one plus its handlers' a batch.
//!
//! Why a held connection and not the engine's transaction: see `db/pinned.rs` (sea-orm's
//! transaction waits for its `BEGIN` and sends its `COMMIT` alone). The attempt is the engine's
//! in everything else, from the same places: the take, the handlers, the records and the
//! completion are the job step's (`JobStep::run_on`, on the held transaction, `db/held.rs`);
//! the attempts and their backoff are [`Retries`]; the evidence is the [`Plan`]'s and is
//! resolved by [`Evidence::resolve`].
//!
//! Where the rules differ, because the completion's reply comes with the `COMMIT`'s:
//! - the evidence is known before the last message leaves: on PostgreSQL the take's message
//!   reads the transaction's id; a marker's INSERT rides in the last message otherwise;
//! - a completion that finds a job asked to stop ([`super::cancel`]) must not commit the
//!   handler's writes: the message checks, after the completion, that it marked every job done,
//!   and the check fails (a subquery of two rows, SQLSTATE 21000) when it did not, so the
//!   server stops the message before its `COMMIT` (MySQL/MariaDB: by the completion's own
//!   count, in the statement that writes the commit marker); the attempt rolls back, reads
//!   which jobs were asked to stop, and the next attempt cancels them, as in the engine;
//! - a completion whose values cannot be written in goes alone and bound, then `COMMIT`;
//! - on PostgreSQL (not behind a transaction pooler) the take, the completion and the check go
//!   as `EXECUTE` of statements prepared on the connection (`held.rs`): as text the server
//!   planned them on every message (0.63 ms for the completion, against 0.05 ms to run it),
//!   which made jobs in few flights slower than the engine's on loopback (0.70×; now 0.97×).
//!
//! A take that claims leased jobs sends their claims' UPDATEs with its `COMMIT` (the take's lock
//! on their rows makes them claim; nobody reads their replies). A leased job's finish goes the
//! same way: its completion requires the claim, so a check that
//! stops the message means the claim is gone, and the next attempt looks at it first and says
//! why (lease lost or cancelled), as in the engine. A finish whose kind's finish sends nothing
//! is one message: `BEGIN`, the commit marker, the completion, then on MySQL/MariaDB the
//! promotion that checks it and claims the key's next job (`store::Chained`, which stands for
//! the check), on PostgreSQL the completion's check (the completion promotes and claims), and
//! `COMMIT`. On PostgreSQL its evidence is a marker, not the transaction's id (which a message
//! before it would read), and its statements go by the names the connection is assumed to
//! have prepared them under: no names are read (`Held::last` prepares them when the
//! connection turns out not to have them). When that message's reply is lost and the
//! evidence says it committed, the job its promotion claimed came back in no reply: it is read
//! by its claim's owner token ([`store::claimed_by`]) and runs at once, not after its lease.
//! Databases other than PostgreSQL and MySQL/MariaDB go through the engine.

mod check;
mod last;
mod pretake;

use std::sync::Arc;

use sea_orm::{ConnectionTrait, DbBackend, DbErr};

use check::{after, stopped};
use last::{Ended, roll_back};
use tracing::warn;

use super::{
    deferred::Deferred,
    job::JobRun,
    step::{JobStep, Source},
    store,
};
use crate::{
    commit::{Evidence, Plan},
    db::{
        deadline::within,
        held::Held,
        inline::statement_text,
        pinned::{Pinned, Reply},
        txn::Txn,
    },
    error::{Result, database},
    schema::JOB_TABLE,
    write::engine::{End, Retries, Tried, Worked},
};

/// Whether `source`'s attempts go in few round trips: asked for, on a PostgreSQL or
/// MySQL/MariaDB pool.
pub(super) fn applies(step: &JobStep<'_>) -> bool {
    let db = step.cx.session.pool();
    step.cx.session.two_flights()
        && db.is_real()
        && matches!(step.source, Source::Take { .. } | Source::Finish(_))
        && matches!(
            db.get_database_backend(),
            DbBackend::Postgres | DbBackend::MySql
        )
}

/// Runs `step`'s attempts on held connections until one settles, as the engine would — and
/// then, while one began the next attempt's transaction after its `COMMIT` (`pretake.rs`), the
/// next the same way: the jobs of every attempt that settled.
pub(super) async fn run(step: &mut JobStep<'_>) -> Result<Vec<JobRun>> {
    let attempts = step.cx.session.policy().write_attempts;
    let began = std::time::Instant::now();
    let mut runs = Vec::new();
    for settled in 0.. {
        let mut retries = Retries::new(JOB_TABLE.to_owned(), attempts, true, None);
        let result = loop {
            retries.start();
            step.send_ahead = pretake::may(step, settled, began.elapsed());
            let tried = attempt(step).await;
            if let Some(result) = retries.settle(tried).await {
                break result;
            }
        };
        match result {
            Ok(ran) => runs.extend(ran),
            Err(error) if runs.is_empty() => return Err(error),
            // The attempts before it committed: their jobs are reported, and the error comes
            // again with the worker's next step if it lasts.
            Err(error) => {
                warn!(%error, "a job attempt on a transaction begun ahead failed");
                return Ok(runs);
            }
        }
        if step.ahead.is_none() {
            break;
        }
        // The next attempt takes what was sent ahead: it follows no key.
        if let Source::Take {
            limit, chain, stop, ..
        } = step.source
        {
            // Told to stop meanwhile: the jobs taken ahead are left to the next take.
            if pretake::stopping(stop) {
                if let Some((held, _)) = step.ahead.take() {
                    roll_back(held, step.cx.reply()).await;
                }
                break;
            }
            step.source = Source::Take {
                limit,
                follow: None,
                chain,
                stop,
            };
        }
    }
    Ok(runs)
}

/// One attempt: the job step on a held transaction, then its end.
async fn attempt(step: &mut JobStep<'_>) -> Result<Tried<Vec<JobRun>>> {
    let failed = |operation, e| Ok(Tried::failed(database(operation, &JOB_TABLE, e)));
    let session = step.cx.session.clone();
    let (db, reply) = (session.pool(), step.cx.reply());
    let held = match step.ahead.take() {
        // Begun after the last attempt's `COMMIT`, its take sent (`pretake.rs`).
        Some((held, plan)) => {
            step.plan = plan;
            held
        }
        None => match hold(step).await {
            Ok(held) => held,
            Err(e) => return failed("beginning the transaction for", e),
        },
    };
    let held = Arc::new(held);
    step.deferred = None;
    let (txn, worked) = step.run_on(Txn::Held(Arc::clone(&held))).await;
    drop(txn);
    let deferred = step.deferred.take();
    // Every `Tx` and savepoint of the attempt is gone with it.
    let Some(held) = Arc::into_inner(held) else {
        let e = DbErr::Custom("the job's transaction outlived its attempt".into());
        return failed("ending the transaction of", e);
    };
    match worked {
        Worked::Undone(tried) => {
            let silent = matches!(&tried, Tried::Failed { error, .. } if error.is_no_reply());
            if !silent {
                roll_back(held, reply).await;
            }
            Ok(tried)
        }
        Worked::Kept {
            value,
            end,
            effects,
        } => {
            match end {
                // With whatever rides in the last message.
                End::Commit if held.begun() => {
                    if let Err(error) = last::end(step, held, None, Vec::new(), None, None).await {
                        step.metrics(false);
                        return Err(error);
                    }
                }
                End::Commit => held.release(),
                End::RollBack => roll_back(held, reply).await,
            }
            session.map().apply(effects);
            step.metrics(true);
            Ok(Tried::Done(value))
        }
        Worked::Write {
            value,
            evidence,
            effects,
            ..
        } => {
            // Nothing completed (claims, failures, cancellations): the plan's evidence, as a
            // completion's would be (a marker's INSERT rides in the `COMMIT`'s message).
            let (evidence, rides) = match (evidence, &deferred) {
                (Some(evidence), Some(deferred)) => (Some(evidence), deferred.rides),
                (Some(evidence), None) => (Some(evidence), false),
                (None, _) => match step.held_evidence(&held).await {
                    Ok(planned) => planned,
                    Err(e) => return failed("marking the commit of", e),
                },
            };
            step.plan = None;
            let ended = commit(step, held, deferred, evidence.as_ref(), rides).await;
            match ended {
                Ok(Committed::Yes) => {}
                Ok(Committed::Stopped) => return Ok(Tried::Uncounted),
                Err(error) => {
                    step.metrics(false);
                    return Err(error);
                }
            }
            session.map().apply(effects);
            step.metrics(true);
            if let Some(evidence) = &evidence {
                crate::commit::committed(evidence, db, reply).await;
            }
            Ok(Tried::Done(value))
        }
    }
}

/// A connection of the pool held for `step`'s attempt, its transaction not begun; `step.plan`
/// set.
async fn hold(step: &mut JobStep<'_>) -> std::result::Result<Held, DbErr> {
    let session = step.cx.session.clone();
    let db = session.pool();
    // Read before the connection is held (a pool of one would wait for itself).
    let begin = crate::db::begin::text(db).await;
    let Some(conn) = Pinned::acquire(db.connection(), db.transaction_pooled()).await else {
        return Err(DbErr::Custom("no held connection on this database".into()));
    };
    let conn = conn?;
    let (plan, with_begin) = self::plan(&session, &conn).await;
    step.plan = plan;
    // freshlock's statements prepared on the connection, unless a pooler shares it.
    Ok(Held::new(conn, begin, with_begin, db.prepares()))
}

/// The plan of the evidence of a transaction on `conn` (`None` without commit markers), known
/// before the transaction begins, and the statement its first message reads for it (on
/// PostgreSQL the transaction's id, and the incarnation's token when the pool has not seen it
/// lately): the attempt reads its evidence with this plan, the one that wrote what was read.
async fn plan(session: &crate::Session, conn: &Pinned) -> (Option<Plan>, Option<String>) {
    let plan = match session.commit_markers() {
        true => Some(Plan::of(session.pool(), conn).await),
        false => None,
    };
    let with_begin = match &plan {
        Some(Plan::Stamped(stamped)) => Some(format!("SELECT {}", stamped.exprs().join(", "))),
        _ => None,
    };
    (plan, with_begin)
}

/// How the last message ended, when it did not fail.
enum Committed {
    /// Committed (or resolved as committed after a lost reply).
    Yes,
    /// The check found a job asked to stop: rolled back, `step.cancelling` says which.
    Stopped,
}

/// The last message: a riding marker's INSERT (`rides`: `evidence` is a marker to write here),
/// the completion, its check and `COMMIT` — or,
/// when the marker or the completion cannot be written in, those bound and on their own (the
/// check made here), then `COMMIT`.
async fn commit(
    step: &mut JobStep<'_>,
    held: Held,
    deferred: Option<Deferred>,
    evidence: Option<&Evidence>,
    rides: bool,
) -> Result<Committed> {
    let reply = step.cx.reply();
    let backend = held.get_database_backend();
    let fail = |operation| move |e| database(operation, &JOB_TABLE, e);
    let marker = match evidence {
        Some(Evidence::Marker(marker)) if rides => Some(marker),
        _ => None,
    };
    // No marker: nothing to write in (`Some("")`).
    let insert = match marker {
        Some(marker) => statement_text(&backend.build(&marker.insert(backend, true))),
        None => Some(String::new()),
    };
    let Some(deferred) = deferred else {
        let statements = match (insert, marker) {
            (Some(insert), _) => Vec::from_iter((!insert.is_empty()).then_some(insert)),
            // Bound, on its own.
            (None, Some(marker)) => {
                (held.begun_before().await).map_err(fail("beginning the transaction for"))?;
                let written = within(reply, marker.write(held.conn())).await;
                written.map_err(fail("marking the commit of"))?;
                Vec::new()
            }
            (None, None) => Vec::new(),
        };
        return last::end(step, held, None, statements, evidence, None)
            .await
            .map(|_| Committed::Yes);
    };
    // A transaction nothing was sent in yet (a leased finish that sent nothing, its evidence a
    // marker that rides) is this one message: by name, its statements assume the connection
    // has them (it read no names; `Held::last` prepares them when it has not).
    let unread = held.names_unread();
    let text = |stmt: &sea_orm::Statement| match unread {
        true => held.assumed(stmt),
        false => held.executed(stmt),
    };
    let completion = text(&deferred.completion.statement());
    // MySQL/MariaDB: a riding marker's INSERT is the completion's check (see `after`).
    let merged =
        marker.filter(|_| backend == DbBackend::MySql && deferred.completion.chained().is_none());
    let insert = match merged {
        Some(_) => Some(String::new()),
        None => insert,
    };
    let after = after(backend, &deferred, step.owner(), merged);
    let checked: Option<Vec<_>> = after.iter().map(text).collect();
    let readied = match (insert, completion, checked) {
        (Some(insert), Some(completion), Some(checked)) => {
            let mut statements = Vec::with_capacity(8);
            if !insert.is_empty() {
                statements.push(insert);
            }
            statements.extend(completion.statements());
            // The completion's reply, before the check's statements.
            let at = statements.len() - 1;
            statements.extend(checked.into_iter().flat_map(|text| text.statements()));
            // The next take, after the `COMMIT` (`pretake.rs`).
            let ahead = pretake::ahead(step, &held, &deferred).await;
            let ids = Some(deferred.ids.as_slice());
            match last::end(step, held, ids, statements, evidence, ahead).await? {
                Ended::Stopped => return Ok(Committed::Stopped),
                // The replies were lost with the `COMMIT`'s: the job the promotion claimed (if
                // any) is read by its claim's owner token, and the worker goes on with it.
                Ended::Resolved => {
                    if let Some((owner, _)) = &deferred.chaining {
                        let db = step.cx.session.pool();
                        match within(step.cx.reply(), store::claimed_by(db.connection(), owner))
                            .await
                        {
                            Ok(claimed) => step.claim_next(claimed, deferred.chaining),
                            // Committed all the same: it waits for its lease to expire.
                            Err(e) => warn!(error = %e, "the claimed job could not be read"),
                        }
                    }
                    0
                }
                Ended::Committed(mut replies) => {
                    let mut reply = |i: usize| replies.get_mut(at + i).map(std::mem::take);
                    let Reply { rows, affected } = reply(0).unwrap_or_default();
                    let completed = match deferred.completion.chained() {
                        // The promotion's count, and the claimed job's row.
                        Some(chained) => {
                            let readied = reply(2).unwrap_or_default().affected;
                            let rows = reply(3).unwrap_or_default().rows;
                            chained.claimed(&rows).map(|claimed| (readied, claimed))
                        }
                        None => (deferred.completion.read(rows, affected))
                            .map(|completed| (completed.readied, completed.claimed)),
                    };
                    match completed {
                        Ok((readied, claimed)) => {
                            step.claim_next(claimed, deferred.chaining);
                            readied
                        }
                        // Committed all the same: the worker only does not follow the key (a
                        // job claimed for it waits for its lease to expire).
                        Err(e) => {
                            warn!(error = %e, "the completion's reply could not be read");
                            0
                        }
                    }
                }
            }
        }
        // Bound, each on its own, and checked here.
        _ => {
            (held.begun_before().await).map_err(fail("beginning the transaction for"))?;
            if let Some(marker) = marker {
                let written = within(reply, marker.write(held.conn())).await;
                written.map_err(fail("marking the commit of"))?;
            }
            let statement = deferred.completion.statement();
            let chained = deferred.completion.chained().cloned();
            let completed = match deferred.completion.returns() {
                true => {
                    let rows = within(reply, held.conn().query_all_raw(statement)).await;
                    let rows = rows.map_err(fail("completing jobs in"))?;
                    deferred.completion.read(rows, 0)
                }
                false => {
                    let done = within(reply, held.conn().execute_raw(statement)).await;
                    let done = done.map_err(fail("completing jobs in"))?.rows_affected();
                    deferred.completion.read(Vec::new(), done)
                }
            };
            let completed = completed.map_err(fail("completing jobs in"))?;
            if completed.done < deferred.ids.len() as u64 {
                return stopped(step, held, &deferred.ids, reply).await;
            }
            let (readied, claimed) = match chained {
                // Its check passes: the completion was counted above.
                Some(chained) => {
                    let conn = held.conn();
                    let found = within(reply, conn.execute_raw(chained.head.clone())).await;
                    found.map_err(fail("readying the next jobs of"))?;
                    let promoted = within(reply, conn.execute_raw(chained.promote.clone())).await;
                    let readied = promoted.map_err(fail("readying the next jobs of"))?;
                    let rows = within(reply, conn.query_all_raw(chained.read.clone())).await;
                    let rows = rows.map_err(fail("readying the next jobs of"))?;
                    let claimed = chained
                        .claimed(&rows)
                        .map_err(fail("readying the next jobs of"))?;
                    (readied.rows_affected(), claimed)
                }
                None => (completed.readied, completed.claimed),
            };
            last::end(step, held, None, Vec::new(), evidence, None).await?;
            step.claim_next(claimed, deferred.chaining);
            readied
        }
    };
    if readied == 1 {
        step.follow = deferred.follow;
    }
    Ok(Committed::Yes)
}
