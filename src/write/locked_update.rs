//! The locked read-modify-write behind [`crate::Repository::locked_update`], and the locked
//! delete, get-or-insert and update-or-insert built on the same driver.
//!
//! The section — lock, transaction, reload, write, commit, cache, release — is a future of its own
//! (the *driver*), and `apply` runs in the caller, between its two halves. They talk over two
//! channels: the driver sends the reloaded row (or its absence), the caller answers with a
//! [`Decision`] (update these columns, insert, delete, or keep the row as it is). The
//! caller polls the driver in place; if the caller is cancelled at any await, the driver moves to
//! a task of its own ([`Detachable`]) instead of being cut in half: it notices the closed
//! channel, rolls back (or, past the point of no return, commits) and releases the lock after the
//! transaction ended. `apply` need not be `'static`, since it never leaves the caller.
//! The driver only takes the row's lock (seated in the row's room when it may combine, see
//! [`crate::write::combine`]) and releases it: the attempts — transaction, fence check, commit with its
//! evidence, cache, retries — are the engine's (`engine.rs`), the reload and the write a step of
//! it (`row_step.rs`).

use crate::write::entity::Writable;
use std::{
    any::TypeId,
    panic::{AssertUnwindSafe, catch_unwind, resume_unwind},
};

use sea_orm::EntityTrait;
use tokio::sync::mpsc;
use tracing::{Instrument, field, info_span};

pub(crate) use crate::write::decision::{Decision, Written};
use crate::{
    db::detach::Detachable,
    error::Result,
    identity_map::Change,
    outcome::Report,
    session::Session,
    write::combine::{self, Followed},
    write::engine::{self, Engine, Retries},
    write::locking::Locking,
    write::room::{Call, RoomKey, Seat, Served},
    write::row::Row,
    write::row_step::RowStep,
};

/// Runs one locked write of `row`: `decide` is called in the caller with the row as reloaded
/// under the lock, and says what to write. It is `FnMut` because a conflict or a transient error
/// runs the section again. `combinable`: `decide` only ever updates or keeps an existing row, so
/// the write may share a commit with other writers of the row (when the session combines
/// commits; see [`crate::write::combine`]).
pub(crate) async fn run<E, D>(
    session: &Session,
    row: Row,
    combinable: bool,
    mut decide: D,
) -> Result<Report<Written<E::Model>>>
where
    E: Writable,
    D: FnMut(Option<E::Model>) -> Result<Decision<E>> + Send,
{
    let (reloaded_tx, mut reloaded) = mpsc::channel::<Option<E::Model>>(1);
    let (decisions, decisions_rx) = mpsc::channel::<Decision<E>>(1);
    // Fields are evaluated only when a subscriber wants the span; the empty ones are filled in
    // when the section ends.
    let span = info_span!(
        "locked_update",
        entity = E::default().table_name(),
        key = row.name.as_str().split_once(':').map_or("", |(_, key)| key),
        lock = %row.lock,
        backend = session.lock_backend().kind().as_str(),
        lock_wait_ms = field::Empty,
        lock_held = field::Empty,
        attempts = field::Empty,
        conflicts = field::Empty,
        outcome = field::Empty,
    );
    let combining = combinable && session.combine_commits();
    let exclusion = combining
        .then(|| crate::write::locking::exclusion(session.lock_backend().as_ref()))
        .flatten();
    let room = exclusion.map(|exclusion| {
        RoomKey::new(
            TypeId::of::<E>(),
            session.db().rooms(),
            exclusion,
            &row.lock,
            &row.name,
            session.version_column(TypeId::of::<E>()),
            session.commit_markers(),
        )
    });
    let driver = Driver::<E> {
        // A write that only updates an existing row tries a `pg_advisory` or `row` lock in its
        // reload (one round trip less); one that may find no row would only pay for a second
        // try.
        step: RowStep::new(
            session.clone(),
            row,
            reloaded_tx,
            decisions_rx,
            room,
            combinable,
        ),
    };
    let mut driver = Detachable::new(driver.run().instrument(span));

    loop {
        // Both halves are polled by this one task (no thread hop per message). The driver only
        // moves to a task of its own if this future is dropped (see `Detachable`).
        let found = tokio::select! {
            biased;
            received = reloaded.recv() => match received {
                Some(found) => found,
                None => break,
            },
            result = &mut driver => return result,
        };
        let abort = match catch_unwind(AssertUnwindSafe(|| decide(found))) {
            Ok(Ok(decision)) => {
                if decisions.send(decision).await.is_err() {
                    break; // The driver is gone; its result says why.
                }
                continue;
            }
            Ok(Err(error)) => Err(error),
            Err(panic) => Ok(panic),
        };
        // Abort: closing the channel makes the driver roll back and release; finish it so the
        // lock is free when the caller sees the error (or the panic).
        drop(decisions);
        let _ = (&mut driver).await;
        match abort {
            Err(error) => return Err(error),
            Ok(panic) => resume_unwind(panic),
        }
    }
    driver.await
}

/// The task that owns the lock and the transaction of one locked write.
struct Driver<E: EntityTrait> {
    /// The row write, run by the engine under the lock.
    step: RowStep<E>,
}

/// What woke a seated waiter first.
enum Woke<E: EntityTrait> {
    /// The holder that took its seat.
    Called(Call<E>),
    /// The lock (or the policy's refusal).
    Taken(Result<Option<Locking>>),
}

impl<E> Driver<E>
where
    E: Writable,
{
    /// Runs the section and records how it ended (see [`engine::record`]).
    async fn run(self) -> Result<Report<Written<E::Model>>> {
        let result = self.run_locked().await;
        engine::record(E::default().table_name(), &result);
        result
    }

    async fn run_locked(mut self) -> Result<Report<Written<E::Model>>> {
        let policy = self.step.session.policy().clone();
        let started = tokio::time::Instant::now();
        // A combining write waits for the lock and, at the same time, for a holder to serve it.
        // Seated before it counts as in flight: a section counted is a seat taken.
        let mut seat = self.step.room.clone().map(Seat::<E>::sit);
        let _in_flight = self.step.session.section_started();
        let locking = loop {
            let woke = match seat.as_mut() {
                None => Woke::Taken(self.take(&policy).await),
                Some(seated) => tokio::select! {
                    biased;
                    call = seated.calls.recv() => Woke::Called(combine::heard(call)),
                    taken = self.take(&policy) => Woke::Taken(taken),
                },
            };
            let taken = match (woke, seat.as_mut()) {
                (Woke::Called(call), Some(seated)) => {
                    match self.follow(Some(call), &mut seated.calls, started).await {
                        Some(result) => return result,
                        None => {
                            seat = None;
                            continue;
                        }
                    }
                }
                (Woke::Called(_), None) => unreachable!("a call comes only through a seat"),
                (Woke::Taken(taken), None) => taken,
                (Woke::Taken(taken), Some(seated)) => {
                    if !seated.leave() {
                        // A holder took the seat while this task took the lock without it (a
                        // policy that proceeds): follow the holder; if it does not serve this
                        // write, take the lock again.
                        if let Ok(Some(locking)) = taken {
                            locking.release().await;
                        }
                        match self.follow(None, &mut seated.calls, started).await {
                            Some(result) => return result,
                            None => {
                                seat = None;
                                continue;
                            }
                        }
                    }
                    taken
                }
            };
            drop(seat.take());
            match taken? {
                Some(locking) => break locking,
                // The caller gave up while we waited.
                None => return Err(self.step.interrupted()),
            }
        };
        let label = self.step.row.name.clone();
        let entity = Some(E::default().table_name());
        let mut retries = Retries::new(label.to_string(), policy.write_attempts, true, entity);
        let mut lockings = [locking];
        let session = self.step.session.clone();
        let engine = Engine {
            db: session.pool(),
            map: session.map(),
            markers: session.commit_markers(),
        };
        let step = &mut self.step;
        // On PostgreSQL, in two round trips where the session asks for it (`flights.rs`); `None`
        // when the engine writes it (or goes on with it).
        #[cfg(any(feature = "postgres", feature = "mysql"))]
        let result = match crate::write::flights::applies(step, &lockings) {
            true => {
                let [locking] = &mut lockings;
                crate::write::flights::run(step, locking, &mut retries).await
            }
            false => None,
        };
        #[cfg(not(any(feature = "postgres", feature = "mysql")))]
        let result = None;
        let result = match result {
            Some(result) => result,
            None => {
                let label = label.as_str();
                engine::run(engine, &mut lockings, &mut retries, label, false, step).await
            }
        };

        // Waiters of the batch that were not finished were not written: they take the lock
        // themselves, after us (before the release, so none of them can take it first).
        drop(self.step.batch.take());
        let batch = self.step.committed;
        let [locking] = lockings;
        // Only now, after commit or rollback. A key that does not exist leaves no lock row.
        let report = if matches!(result, Ok(Written::NotFound)) {
            locking.retire().await
        } else {
            locking.release().await
        };
        result.map(|outcome| Report {
            outcome,
            lock: report,
            attempts: retries.attempts,
            conflicts: retries.conflicts,
            batch,
        })
    }

    /// Takes the lock (the in-process queue, then the backend's), as the policy says.
    async fn take(&self, policy: &crate::lock::LockPolicy) -> Result<Option<Locking>> {
        let (row, reloaded) = (&self.step.row, &self.step.reloaded);
        Locking::take(
            self.step.session.lock_backend(),
            policy,
            &row.lock,
            row.name.clone(),
            reloaded.closed(),
            || reloaded.is_closed(),
        )
        .await
    }

    /// A seated waiter follows the holder that took its seat (see [`combine::follow`]):
    /// `None` when it was not served and must take the lock itself.
    async fn follow(
        &mut self,
        first: Option<Call<E>>,
        calls: &mut mpsc::UnboundedReceiver<Call<E>>,
        started: tokio::time::Instant,
    ) -> Option<Result<Report<Written<E::Model>>>> {
        let step = &mut self.step;
        let (session, key) = (&step.session, &step.row.key);
        let evict = || {
            session.map().remove(key);
        };
        let followed =
            combine::follow(first, calls, &step.reloaded, &mut step.decisions, evict).await;
        match followed {
            Followed::Again => None,
            Followed::Gone => Some(Err(self.step.interrupted())),
            Followed::Finished(result) => Some(result.map(|served| self.served(served, started))),
        }
    }

    /// A served waiter's report; its session caches the committed row.
    fn served(
        &self,
        served: Served<E::Model>,
        started: tokio::time::Instant,
    ) -> Report<Written<E::Model>> {
        if let Some(stored) = served.stored {
            let changes = [Change::cache(self.step.row.key.clone(), stored)];
            self.step.session.map().apply(changes);
        }
        let mut lock = served.lock;
        lock.waited = started.elapsed();
        Report {
            outcome: served.outcome,
            lock,
            attempts: 1,
            conflicts: 0,
            batch: served.batch,
        }
    }
}
