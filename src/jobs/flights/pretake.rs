//! The next take, sent ahead: a worker's loop ([`Worker::run`](crate::jobs::Worker::run),
//! `run_until_idle`, `drain`) that took jobs takes again at once, so a held attempt sends the
//! next attempt's `BEGIN` and take in its last message, after the `COMMIT` — `…; COMMIT;
//! START TRANSACTION; SELECT … FOR UPDATE SKIP LOCKED` (PostgreSQL: `BEGIN; EXECUTE
//! freshlock_…(…); SELECT <the transaction's id>`) — and the step runs the next attempt
//! on that transaction: a job whose handler sends one statement is two round trips instead of
//! three (the handler's, then the completion, `COMMIT` and the next take), which is what a
//! link with latency pays (`BENCHMARKS.md`, W2 through 1 ms each way).
//!
//! What keeps it from losing or doubling a job:
//! - the server runs the message in order and stops at its first failing statement: a take
//!   that fails after the `COMMIT` leaves the commit made. The attempt reads the replies up to
//!   the failure (`Pinned::flight_until`): with the `COMMIT`'s among them, the jobs committed
//!   and are reported so, and the connection — in a transaction that failed — is closed;
//!   without, nothing of the message committed, as before;
//! - a message whose reply is lost is resolved by its evidence as any last message; the taken
//!   rows were locked by a transaction on the lost connection, which the server rolls back;
//! - the next attempt's take reads the rows sent ahead only when it sends the same text
//!   ([`Held::carry`]): any other first query (a take whose kinds were narrowed by a limit)
//!   goes on its own in the same transaction, where the rows locked ahead are its own;
//! - nothing is sent ahead of a job whose completion may ready its key's next job for the
//!   worker to follow (a single keyed job), of an attempt that claimed leased jobs (their work
//!   runs after the commit: the next transaction would stay open over it), nor by a step
//!   older than [`AHEAD_FOR`] or [`AHEAD_ATTEMPTS`] attempts: the worker's loop looks at its
//!   chores and wake-ups between steps;
//! - a loop told to stop while a step runs (`Source::Take`'s `stop`) sends nothing ahead from
//!   then on (the flag is read again as the last message is written), and rolls back a
//!   transaction begun ahead by a message already on its way instead of running its jobs: a
//!   stopping worker finishes the job it runs and takes no other, as without the take ahead;
//! - only from a transaction that knows what a first message reads ([`Held::carries`]): the
//!   names of the statements the connection prepared (PostgreSQL, read with its `BEGIN`;
//!   the take goes by name, its `PREPARE` before it when the connection lacks it) — the next
//!   transaction's `BEGIN`, take and the statements read with `BEGIN` (the evidence's
//!   transaction id) all ride after the `COMMIT`, and it goes on knowing those names. Not
//!   behind a transaction pooler: untried there, where the pooler would have to keep its
//!   server connection for a transaction begun mid-message.

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use tracing::warn;

use super::super::{
    deferred::Deferred,
    step::{JobStep, Source},
    store,
};
use crate::{
    commit::Plan,
    db::{held::Held, inline::statement_text, pinned::Reply},
};

/// How many attempts a step runs on transactions begun ahead, at most.
pub(super) const AHEAD_ATTEMPTS: u32 = 16;

/// How long a step goes on with transactions begun ahead, at most.
pub(super) const AHEAD_FOR: Duration = Duration::from_millis(250);

/// The next take, to send after a `COMMIT`.
pub(super) struct Ahead {
    /// The statements that begin the next transaction, the take and what is read with
    /// `BEGIN`, one each ([`Held::begin_ahead`]).
    statements: Vec<String>,
    /// The index of the take's reply among theirs.
    at: usize,
    /// The take's text, for the next attempt's take to match.
    take: String,
    /// The plan of the next transaction's evidence, which decided what the statements read
    /// for it (`super::plan`): its attempt's, whatever the pool knows once it starts.
    plan: Option<Plan>,
}

impl Ahead {
    /// The statements to send after the `COMMIT`.
    pub(super) fn statements(&self) -> &[String] {
        &self.statements
    }
}

/// Whether the next attempt of `step` may begin ahead (see the module docs): a loop's take,
/// `attempts` in, `age` old.
/// (A stop is read as the last message is written, in [`ahead`].)
pub(super) fn may(step: &JobStep<'_>, attempts: u32, age: Duration) -> bool {
    matches!(step.source, Source::Take { chain: true, .. })
        && attempts < AHEAD_ATTEMPTS
        && age < AHEAD_FOR
}

/// Whether the loop running the step was told to stop (`Source::Take`'s `stop`).
pub(super) fn stopping(stop: Option<&AtomicBool>) -> bool {
    stop.is_some_and(|stop| stop.load(Ordering::SeqCst))
}

/// The next take to send after the `COMMIT` of `step`'s attempt on `held`, whose completion is
/// `deferred`; `None` when nothing goes ahead (see the module docs).
pub(super) async fn ahead(step: &JobStep<'_>, held: &Held, deferred: &Deferred) -> Option<Ahead> {
    let Source::Take {
        limit, chain, stop, ..
    } = step.source
    else {
        return None;
    };
    let free = step.claimed.is_empty() && deferred.follow.is_none() && deferred.chaining.is_none();
    let pooled = step.cx.session.pool().transaction_pooled();
    if !(step.send_ahead && free && held.carries()) || pooled || stopping(stop) {
        return None;
    }
    let backend = sea_orm::ConnectionTrait::get_database_backend(held);
    let kinds = step.cx.kinds();
    let take = store::take_statement(backend, kinds, limit, chain && limit == 1)?;
    let (plan, with_begin) = super::plan(&step.cx.session, held.conn()).await;
    let (statements, at) = held.begin_ahead(&take, with_begin)?;
    let take = statement_text(&take)?;
    Some(Ahead {
        statements,
        at,
        take,
        plan,
    })
}

/// After the last message committed: the next transaction, with its evidence's plan, when
/// `ahead` was sent and every statement of it answered (`replies`: those after the `COMMIT`'s);
/// else the connection goes back to the pool, or is closed when a statement sent ahead failed.
pub(super) fn carried(
    held: Held,
    ahead: Option<Ahead>,
    replies: Vec<Reply>,
) -> Option<(Held, Option<Plan>)> {
    let Some(ahead) = ahead else {
        held.release();
        return None;
    };
    if replies.len() < ahead.statements.len() {
        warn!("the take sent after the commit failed: its connection is closed");
        drop(held);
        return None;
    }
    Some((held.carry(ahead.take, replies, ahead.at), ahead.plan))
}
