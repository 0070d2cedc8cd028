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

use std::{
    any::TypeId,
    panic::{AssertUnwindSafe, catch_unwind, resume_unwind},
    sync::Arc,
    time::Duration,
};

use backon::{BackoffBuilder, ExponentialBuilder};
use sea_orm::{
    ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, EntityTrait, IdenStatic,
    IntoActiveModel, ModelTrait, QuerySelect,
};
use tokio::sync::{mpsc, oneshot};
use tracing::{Instrument, debug, field, info_span, warn};

pub(crate) use crate::decision::{Decision, Written};
use crate::{
    combine::{self, Call, MAX_BATCH, RoomKey, Seat, Served},
    commit::{self, Marker},
    deadline::within,
    detach::Detachable,
    error::{Error, Result, database},
    locking::Locking,
    outcome::{LockReport, Report},
    row::{Row, select_by_key},
    session::Session,
    write,
};

/// Runs one locked write of `row`: `decide` is called in the caller with the row as reloaded
/// under the lock, and says what to write. It is `FnMut` because a conflict or a transient error
/// runs the section again. `combinable`: `decide` only ever updates or keeps an existing row, so
/// the write may share a commit with other writers of the row (when the session combines
/// commits; see [`crate::combine`]).
pub(crate) async fn run<E, D>(
    session: &Session,
    row: Row,
    combinable: bool,
    mut decide: D,
) -> Result<Report<Written<E::Model>>>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
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
        backend = session.lock_backend().kind(),
        lock_wait_ms = field::Empty,
        lock_held = field::Empty,
        attempts = field::Empty,
        conflicts = field::Empty,
        outcome = field::Empty,
    );
    let room = (combinable && session.combine_commits())
        .then(|| {
            RoomKey::new(
                TypeId::of::<E>(),
                session.connection(),
                crate::locking::exclusion(session.lock_backend()),
                &row.lock,
                &row.name,
                session.version_column(TypeId::of::<E>()),
                session.commit_markers(),
            )
        })
        .flatten();
    let driver = Driver::<E> {
        session: session.clone(),
        row,
        reloaded: reloaded_tx,
        decisions: decisions_rx,
        room,
        batch: None,
        committed: 1,
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

/// How one run of the locked section ended.
enum Step<M> {
    /// With an outcome to report.
    Done(Written<M>),
    /// The optimistic guard refused the write (or a concurrent creator won): run it again.
    Conflict,
    /// A combined waiter's hook failed after it may have written in the transaction: that waiter
    /// got its error, and the attempt runs again without it (not counted as a conflict).
    Again,
}

/// The task that owns the lock and the transaction of one locked write.
struct Driver<E: EntityTrait> {
    session: Session,
    row: Row,
    reloaded: mpsc::Sender<Option<E::Model>>,
    decisions: mpsc::Receiver<Decision<E>>,
    /// The row's room when this write may share a commit (see [`crate::combine`]).
    room: Option<RoomKey>,
    /// The waiters this holder serves (taken on its first attempt that writes), when combining.
    batch: Option<Vec<Member<E>>>,
    /// How many writes the committed transaction carried (1 unless combined).
    committed: u32,
}

/// A waiter served by this holder, and where its turn stands in the current attempt.
struct Member<E: EntityTrait> {
    calls: mpsc::UnboundedSender<Call<E>>,
    state: Turn,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Turn {
    /// Not (yet) served in this attempt.
    Waiting,
    /// Its change is in this attempt's write (`changed`: it changed something).
    Merged { changed: bool },
    /// It has its answer (a result, or its own error), or is gone.
    Out,
}

impl<E: EntityTrait> Member<E> {
    fn finish(&mut self, result: Result<Served<E::Model>>) {
        self.state = Turn::Out;
        let _ = self.calls.send(Call::Done(result));
    }
}

impl<E: EntityTrait> Drop for Member<E> {
    /// A member the batch did not finish was not written: it takes the lock itself.
    fn drop(&mut self) {
        if self.state != Turn::Out {
            let _ = self.calls.send(Call::Again);
        }
    }
}

/// What woke a seated waiter first.
enum Woke<E: EntityTrait> {
    /// The holder that took its seat.
    Called(Call<E>),
    /// The lock (or the policy's refusal).
    Taken(Result<Option<Locking>>),
}

/// How following a holder ended, for a seated waiter.
enum Followed<M> {
    /// With this write's result.
    Finished(Result<Report<Written<M>>>),
    /// Not served: take the lock.
    Again,
}

impl<E> Driver<E>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
    /// Runs the section and records how it ended (span fields, metrics).
    async fn run(self) -> Result<Report<Written<E::Model>>> {
        let entity = E::default().table_name();
        let result = self.run_locked().await;
        let outcome = match &result {
            Ok(report) => {
                let span = tracing::Span::current();
                span.record("lock_wait_ms", report.lock.waited.as_secs_f64() * 1e3);
                span.record("lock_held", report.lock.held);
                span.record("attempts", report.attempts);
                span.record("conflicts", report.conflicts);
                report.outcome.name()
            }
            Err(Error::Interrupted { .. }) => "interrupted",
            Err(Error::Conflict { .. }) => "conflict",
            Err(Error::LockNotAcquired { .. }) => "lock_not_acquired",
            Err(_) => "error",
        };
        tracing::Span::current().record("outcome", outcome);
        crate::metrics::update(entity, outcome);
        result
    }

    async fn run_locked(mut self) -> Result<Report<Written<E::Model>>> {
        let policy = self.session.policy().clone();
        let started = tokio::time::Instant::now();
        // A combining write waits for the lock and, at the same time, for a holder to serve it.
        // Seated before it counts as in flight: a section counted is a seat taken.
        let mut seat = self.room.clone().map(Seat::<E>::sit);
        let _in_flight = self.session.section_started();
        let mut locking = loop {
            let woke = match seat.as_mut() {
                None => Woke::Taken(self.take(&policy).await),
                Some(seated) => tokio::select! {
                    biased;
                    call = seated.calls.recv() => Woke::Called(heard(call)),
                    taken = self.take(&policy) => Woke::Taken(taken),
                },
            };
            let taken = match (woke, seat.as_mut()) {
                (Woke::Called(call), Some(seated)) => {
                    match self.follow(Some(call), &mut seated.calls, started).await {
                        Followed::Finished(result) => return result,
                        Followed::Again => {
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
                            Followed::Finished(result) => return result,
                            Followed::Again => {
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
                None => return Err(self.interrupted()), // The caller gave up while we waited.
            }
        };
        let (mut attempts, mut conflicts) = (0, 0);
        let mut delays = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(2))
            .with_max_delay(Duration::from_millis(200))
            .with_jitter()
            .with_max_times(policy.write_attempts.saturating_sub(1) as usize)
            .build();
        let result = loop {
            attempts += 1;
            let step = self.section(&mut locking).await;
            let retry = match &step {
                Ok(Step::Done(_)) => false,
                Ok(Step::Again) => {
                    // Not an attempt of this write: its own change was not refused.
                    attempts -= 1;
                    continue;
                }
                Ok(Step::Conflict) => {
                    conflicts += 1;
                    crate::metrics::conflict(E::default().table_name());
                    warn!(row = %self.row.name, attempts, "conflict: the row changed since it was read");
                    true
                }
                Err(error) if error.is_transient() => {
                    warn!(row = %self.row.name, attempts, %error, "transient database error");
                    true
                }
                Err(_) => false,
            };
            match (step, retry.then(|| delays.next()).flatten()) {
                (Ok(Step::Done(outcome)), _) => break Ok(outcome),
                (Ok(Step::Again), _) => unreachable!("handled above"),
                (Ok(Step::Conflict), None) => {
                    break Err(Error::Conflict {
                        target: self.row.to_string(),
                        attempts,
                    });
                }
                (Err(error), None) => break Err(error),
                (_, Some(delay)) => {
                    debug!(row = %self.row.name, ?delay, "running the locked section again");
                    tokio::time::sleep(delay).await;
                }
            }
        };

        // Waiters of the batch that were not finished were not written: they take the lock
        // themselves, after us (before the release, so none of them can take it first).
        drop(self.batch.take());
        let batch = self.committed;
        // Only now, after commit or rollback. A key that does not exist leaves no lock row.
        let report = if matches!(result, Ok(Written::NotFound)) {
            locking.retire().await
        } else {
            locking.release().await
        };
        result.map(|outcome| Report {
            outcome,
            lock: report,
            attempts,
            conflicts,
            batch,
        })
    }

    /// Takes the lock (the in-process queue, then the backend's), as the policy says.
    async fn take(&self, policy: &crate::lock::LockPolicy) -> Result<Option<Locking>> {
        Locking::take(
            self.session.lock_backend(),
            policy,
            &self.row.lock,
            self.row.name.clone(),
            self.reloaded.closed(),
            || self.reloaded.is_closed(),
        )
        .await
    }

    /// A seated waiter follows the holder that took its seat: it relays each offered row to its
    /// caller's `apply` and the decision back, until the holder says how the batch ended.
    async fn follow(
        &mut self,
        first: Option<Call<E>>,
        calls: &mut mpsc::UnboundedReceiver<Call<E>>,
        started: tokio::time::Instant,
    ) -> Followed<E::Model> {
        let mut next = first;
        loop {
            let call = match next.take() {
                Some(call) => call,
                None => heard(calls.recv().await),
            };
            match call {
                Call::Again => return Followed::Again,
                Call::Done(result) => {
                    return Followed::Finished(result.map(|served| self.served(served, started)));
                }
                Call::Offer { row, reply } => {
                    self.session.map().remove(&self.row.key);
                    if self.reloaded.send(Some(row)).await.is_err() {
                        return Followed::Finished(Err(self.interrupted()));
                    }
                    // `None`: our caller's `apply` failed or panicked, or it is gone. Dropping
                    // `reply` tells the holder; the caller returns its own error.
                    let Some(decision) = self.decisions.recv().await else {
                        return Followed::Finished(Err(self.interrupted()));
                    };
                    let _ = reply.send(decision);
                }
            }
        }
    }

    /// A served waiter's report; its session caches the committed row.
    fn served(
        &self,
        served: Served<E::Model>,
        started: tokio::time::Instant,
    ) -> Report<Written<E::Model>> {
        if let Some(stored) = served.stored {
            self.session.map().insert(self.row.key.clone(), stored);
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

    /// Evict, begin, reload, hand over to the caller, write what it decided, commit, cache.
    async fn section(&mut self, locking: &mut Locking) -> Result<Step<E::Model>> {
        let db = self.session.connection();
        self.session.map().remove(&self.row.key);
        let txn = locking.begin(db).await?;

        let found = match within(self.reply(), reload_for_update::<E>(&txn, self.row.pk())).await {
            Ok(found) => found,
            Err(e) => return Err(self.rolled_back(txn, "reloading", e).await),
        };
        if self.reloaded.send(found).await.is_err() {
            return Err(self.abandoned(txn).await);
        }
        let Some(decision) = self.decisions.recv().await else {
            return Err(self.abandoned(txn).await);
        };
        match decision {
            Decision::NotFound => {
                finish(txn, End::RollBack, &self.row, self.reply()).await?;
                Ok(Step::Done(Written::NotFound))
            }
            Decision::Keep(original) => {
                finish(txn, End::Commit, &self.row, self.reply()).await?;
                debug!(row = %self.row.name, "unchanged");
                Ok(Step::Done(Written::Unchanged(self.cache(original))))
            }
            Decision::Update { original, draft } => {
                self.update(txn, locking, original, draft).await
            }
            Decision::Insert(draft) => self.insert(txn, draft).await,
            Decision::Delete(original) => self.delete(txn, locking, original).await,
        }
    }

    /// `before_save`, the waiters of the batch served (when combining), the guarded UPDATE
    /// (fence checked first), `after_save`, commit, and every served waiter told.
    async fn update(
        &mut self,
        txn: DatabaseTransaction,
        locking: &mut Locking,
        original: E::Model,
        draft: E::ActiveModel,
    ) -> Result<Step<E::Model>> {
        let mut draft = match write::before_save::<E, _>(draft, &txn, false).await {
            Ok(draft) => draft,
            Err(e) => return Err(self.rolled_back(txn, "running before_save for", e).await),
        };
        let mut changes = write::changed_columns::<E>(&original, &mut draft);
        if changes
            .iter()
            .any(|(column, _)| write::is_primary_key::<E>(column))
        {
            let _ = txn.rollback().await;
            return Err(Error::PrimaryKeyChanged {
                target: self.row.to_string(),
            });
        }
        // Only a holder that excludes the process's other writers of the row may serve them.
        if self.room.is_some() && locking.excludes_process() {
            match self.serve(&txn, &original, &mut changes).await {
                Ok(true) => {}
                Ok(false) => {
                    let _ = txn.rollback().await;
                    return Ok(Step::Again);
                }
                Err(e) => return Err(self.rolled_back(txn, "combining writes of", e).await),
            }
        }
        if changes.is_empty() {
            finish(txn, End::Commit, &self.row, self.reply()).await?;
            let row = self.cache(original);
            self.tell_committed(locking, &row, Vec::new());
            return Ok(Step::Done(Written::Unchanged(row)));
        }
        // The lease (table backend) is released in this transaction: the commit ends it.
        if let Some(step) = self.fence(&txn, locking, true).await? {
            let _ = txn.rollback().await;
            return Ok(step);
        }
        // The optimistic guard: the UPDATE also checks that the row still holds what was read
        // (its version column when one is declared, else the changed columns), so a write made
        // without the lock can never overwrite a change it did not see.
        let expected = match self.session.version_column(TypeId::of::<E>()) {
            Some(name) => {
                let Some(column) = write::column_named::<E>(name) else {
                    let _ = txn.rollback().await;
                    return Err(self.version_error(name));
                };
                let read = original.get(column);
                let Some(next) = write::next_version(&read) else {
                    let _ = txn.rollback().await;
                    return Err(self.version_error(name));
                };
                changes.retain(|(changed, _)| changed.as_str() != name);
                changes.push((column, next));
                vec![(column, read)]
            }
            None => changes
                .iter()
                .map(|(column, _)| (*column, original.get(*column)))
                .collect(),
        };
        // The evidence a lost commit reply is resolved with: a marker row with a token of this
        // write's own (see `commit.rs`). On PostgreSQL it rides in the UPDATE's own statement;
        // elsewhere it is one INSERT first.
        let marker = self.session.commit_markers().then(Marker::new);
        let backend = txn.get_database_backend();
        let reply = self.reply();
        let update = || write::update_returning::<E, _>(&txn, &original, &changes, &expected);
        let written = match &marker {
            Some(marker) if backend == DbBackend::Postgres => {
                let insert = marker.insert(backend, true);
                let update = write::update_returning_marked::<E, _>(
                    &txn, &original, &changes, &expected, insert,
                );
                within(reply, update).await
            }
            Some(marker) => match within(reply, marker.write(&txn)).await {
                Ok(()) => within(reply, update()).await,
                Err(e) => return Err(self.rolled_back(txn, "marking the commit of", e).await),
            },
            None => within(reply, update()).await,
        };
        let stored = match written {
            Ok(Some(stored)) => stored,
            Ok(None) => {
                finish(txn, End::RollBack, &self.row, self.reply()).await?;
                return Ok(Step::Conflict);
            }
            Err(e) => return Err(self.rolled_back(txn, "writing", e).await),
        };
        let reported = match write::after_save::<E, _>(stored.clone(), &txn, false).await {
            Ok(reported) => reported,
            Err(e) => return Err(self.rolled_back(txn, "running after_save for", e).await),
        };
        // Each served waiter that changed something gets its own `after_save`.
        let mut theirs = Vec::new();
        for (index, member) in self.batch.iter_mut().flatten().enumerate() {
            if member.state != (Turn::Merged { changed: true }) {
                continue;
            }
            match write::after_save::<E, _>(stored.clone(), &txn, false).await {
                Ok(reported) => theirs.push((index, reported)),
                Err(e) => {
                    member.finish(Err(database("running after_save for", &self.row, e)));
                    let _ = txn.rollback().await;
                    return Ok(Step::Again);
                }
            }
        }
        let (db, target) = (self.session.connection(), self.row.name.as_str());
        let committed = match &marker {
            Some(marker) => commit::commit(txn, marker, db, target, reply).await,
            None => commit::commit_write(txn, false, db, target, reply).await,
        };
        if committed.is_ok() {
            locking.committed();
        }
        if let Err(error) = committed {
            if let Error::CommitUnknown { source, .. } = &error {
                // Every write of the batch is in doubt alike; none may run again blindly.
                let why = source.to_string();
                for member in self.batch.iter_mut().flatten() {
                    if let Turn::Merged { .. } = member.state {
                        member.finish(Err(Error::CommitUnknown {
                            target: self.row.to_string(),
                            source: why.clone().into(),
                        }));
                    }
                }
            }
            return Err(error);
        }
        let stored = self.cache(stored);
        self.tell_committed(locking, &stored, theirs);
        debug!(row = %self.row.name, batch = self.committed, "updated");
        Ok(Step::Done(Written::Updated(Arc::new(reported))))
    }

    /// Serves the batch (taken from the room on the first attempt that gets here): each waiter
    /// runs its `apply` on the row as the ones before it left it, and its change is merged into
    /// `changes`. `Ok(false)`: a waiter's `before_save` failed, or changed the primary key, after
    /// it may have written in the transaction; that waiter got its error, and the attempt must
    /// run again without it.
    async fn serve(
        &mut self,
        txn: &DatabaseTransaction,
        original: &E::Model,
        changes: &mut Vec<write::ColumnValue<E>>,
    ) -> std::result::Result<bool, DbErr> {
        let Some(room) = &self.room else {
            return Ok(true);
        };
        let members = self.batch.get_or_insert_with(|| {
            combine::take_seats::<E>(room, MAX_BATCH - 1)
                .into_iter()
                .map(|calls| Member {
                    calls,
                    state: Turn::Waiting,
                })
                .collect()
        });
        let mut current = original.clone();
        for (column, value) in changes.iter() {
            current.try_set(*column, value.clone())?;
        }
        for member in members.iter_mut() {
            if member.state == Turn::Out {
                continue;
            }
            member.state = Turn::Waiting;
            let (reply, answer) = oneshot::channel();
            let offer = Call::Offer {
                row: current.clone(),
                reply,
            };
            // A closed channel or a dropped reply: the waiter is gone, or its `apply` failed or
            // panicked. It contributes nothing and returns its own error.
            if member.calls.send(offer).is_err() {
                member.state = Turn::Out;
                continue;
            }
            let Ok(decision) = answer.await else {
                member.state = Turn::Out;
                continue;
            };
            match decision {
                Decision::Update {
                    original: seen,
                    draft,
                } => {
                    let mut draft = match write::before_save::<E, _>(draft, txn, false).await {
                        Ok(draft) => draft,
                        Err(e) => {
                            member.finish(Err(database("running before_save for", &self.row, e)));
                            return Ok(false);
                        }
                    };
                    let theirs = write::changed_columns::<E>(&seen, &mut draft);
                    if theirs
                        .iter()
                        .any(|(column, _)| write::is_primary_key::<E>(column))
                    {
                        member.finish(Err(Error::PrimaryKeyChanged {
                            target: self.row.to_string(),
                        }));
                        return Ok(false);
                    }
                    member.state = Turn::Merged {
                        changed: !theirs.is_empty(),
                    };
                    for (column, value) in theirs {
                        current.try_set(column, value.clone())?;
                        match changes
                            .iter_mut()
                            .find(|(changed, _)| changed.as_str() == column.as_str())
                        {
                            Some(slot) => slot.1 = value,
                            None => changes.push((column, value)),
                        }
                    }
                }
                Decision::Keep(_) => member.state = Turn::Merged { changed: false },
                // Not an update of this row: it runs alone, after this batch.
                Decision::NotFound | Decision::Insert(_) | Decision::Delete(_) => {
                    member.state = Turn::Out;
                    let _ = member.calls.send(Call::Again);
                }
            }
        }
        Ok(true)
    }

    /// After the commit: every waiter merged into it gets its report, with the committed row
    /// (`theirs`: the rows their own `after_save` returned, by member index).
    fn tell_committed(
        &mut self,
        locking: &Locking,
        stored: &Arc<E::Model>,
        theirs: Vec<(usize, E::Model)>,
    ) {
        let Some(members) = self.batch.as_mut() else {
            return;
        };
        let merged = members
            .iter()
            .filter(|member| matches!(member.state, Turn::Merged { .. }))
            .count();
        let batch = u32::try_from(merged + 1).unwrap_or(u32::MAX);
        self.committed = batch;
        let mut theirs = theirs.into_iter().peekable();
        for (index, member) in members.iter_mut().enumerate() {
            let Turn::Merged { changed } = member.state else {
                continue;
            };
            let outcome = match theirs.next_if(|(at, _)| *at == index) {
                Some((_, reported)) => Written::Updated(Arc::new(reported)),
                None if changed => Written::Updated(Arc::clone(stored)),
                None => Written::Unchanged(Arc::clone(stored)),
            };
            let lock = LockReport {
                tries: 0,
                waited: Duration::ZERO,
                release_error: None,
                ..locking.report.clone()
            };
            member.finish(Ok(Served {
                outcome,
                stored: Some(Arc::clone(stored)),
                lock,
                batch,
            }));
        }
    }
    /// `before_save`, INSERT … RETURNING, `after_save`, commit. No fence check: an insert cannot
    /// overwrite anything, and a concurrent creator makes it fail on the key (a conflict: the
    /// next attempt finds the winner's row).
    async fn insert(
        &self,
        txn: DatabaseTransaction,
        draft: E::ActiveModel,
    ) -> Result<Step<E::Model>> {
        let draft = match write::before_save::<E, _>(draft, &txn, true).await {
            Ok(draft) => draft,
            Err(e) => return Err(self.rolled_back(txn, "running before_save for", e).await),
        };
        let stored = match E::insert(draft).exec_with_returning(&txn).await {
            Ok(stored) => stored,
            Err(e) if write::is_unique_violation(&e) => {
                finish(txn, End::RollBack, &self.row, self.reply()).await?;
                return Ok(Step::Conflict);
            }
            Err(e) => return Err(self.rolled_back(txn, "inserting", e).await),
        };
        let reported = match write::after_save::<E, _>(stored.clone(), &txn, true).await {
            Ok(reported) => reported,
            Err(e) => return Err(self.rolled_back(txn, "running after_save for", e).await),
        };
        self.commit(txn).await?;
        self.cache(stored);
        debug!(row = %self.row.name, "inserted");
        Ok(Step::Done(Written::Inserted(Arc::new(reported))))
    }

    /// Fence, `before_delete`, DELETE (guarded by the version column when one is declared),
    /// `after_delete`, commit, evict.
    async fn delete(
        &self,
        txn: DatabaseTransaction,
        locking: &mut Locking,
        original: E::Model,
    ) -> Result<Step<E::Model>> {
        if let Some(step) = self.fence(&txn, locking, false).await? {
            let _ = txn.rollback().await;
            return Ok(step);
        }
        let draft = original.clone().into_active_model();
        let draft = match write::before_delete::<E, _>(draft, &txn).await {
            Ok(draft) => draft,
            Err(e) => return Err(self.rolled_back(txn, "running before_delete for", e).await),
        };
        let version = self.session.version_column(TypeId::of::<E>());
        let expected = write::version_guard::<E>(version, &original);
        match write::delete_holding::<E, _>(&txn, self.row.pk(), &expected).await {
            Ok(true) => {}
            Ok(false) => {
                finish(txn, End::RollBack, &self.row, self.reply()).await?;
                return Ok(Step::Conflict);
            }
            Err(e) => return Err(self.rolled_back(txn, "deleting", e).await),
        }
        if let Err(e) = write::after_delete::<E, _>(draft, &txn).await {
            return Err(self.rolled_back(txn, "running after_delete for", e).await);
        }
        self.commit(txn).await?;
        self.session.map().remove(&self.row.key);
        debug!(row = %self.row.name, "deleted");
        Ok(Step::Done(Written::Deleted(Arc::new(original))))
    }

    /// The lease's fence check in the write's transaction: `Some(LeaseLost)` when a newer holder
    /// has the lock (the caller rolls back).
    async fn fence(
        &self,
        txn: &DatabaseTransaction,
        locking: &mut Locking,
        releasing: bool,
    ) -> Result<Option<Step<E::Model>>> {
        match locking.verify(txn, releasing).await {
            Ok(true) => Ok(None),
            Ok(false) => {
                warn!(row = %self.row.name, fence = locking.report.fence, "lease lost before the write; nothing written");
                crate::metrics::lease_lost(locking.report.backend);
                Ok(Some(Step::Done(Written::LeaseLost)))
            }
            Err(source) => Err(Error::Lock {
                target: self.row.to_string(),
                source,
            }),
        }
    }

    /// Commits a write, with a commit marker when the session writes them: a lost reply is
    /// resolved, never run twice blindly.
    async fn commit(&self, txn: DatabaseTransaction) -> Result<()> {
        crate::commit::commit_write(
            txn,
            self.session.commit_markers(),
            self.session.connection(),
            self.row.name.as_str(),
            self.reply(),
        )
        .await
    }

    /// Caches `model` as this row's committed state.
    fn cache(&self, model: E::Model) -> Arc<E::Model> {
        let model = Arc::new(model);
        self.session
            .map()
            .insert(self.row.key.clone(), Arc::clone(&model));
        model
    }

    fn version_error(&self, column: &'static str) -> Error {
        Error::VersionColumn {
            entity: E::default().table_name(),
            column,
        }
    }

    /// The caller is gone or aborted: roll back, and report (to nobody, or to a caller that
    /// returns its own error instead).
    async fn abandoned(&self, txn: DatabaseTransaction) -> Error {
        commit::rollback(txn, self.reply()).await;
        self.interrupted()
    }

    async fn rolled_back(
        &self,
        txn: DatabaseTransaction,
        operation: &'static str,
        e: DbErr,
    ) -> Error {
        commit::rollback(txn, self.reply()).await;
        database(operation, &self.row, e)
    }

    /// The bound on each round trip of this write (see `deadline.rs`).
    fn reply(&self) -> Duration {
        self.session.policy().reply_deadline()
    }

    fn interrupted(&self) -> Error {
        Error::Interrupted {
            target: self.row.to_string(),
        }
    }
}

/// The row, read in `txn` (`FOR UPDATE` where the database has it; SQLite's `BEGIN IMMEDIATE`
/// already excludes other writers).
async fn reload_for_update<E: EntityTrait>(
    txn: &DatabaseTransaction,
    pk: &sea_orm::sea_query::ValueTuple,
) -> std::result::Result<Option<E::Model>, DbErr> {
    let mut reload = select_by_key::<E>(pk);
    if txn.get_database_backend() != DbBackend::Sqlite {
        reload = reload.lock_exclusive();
    }
    reload.one(txn).await
}

/// A seated waiter's next call: a holder that vanished without a word (its channel closed) wrote
/// nothing of ours — it panicked before its commit, and its transaction rolled back — so that is
/// [`Call::Again`].
fn heard<E: EntityTrait>(call: Option<Call<E>>) -> Call<E> {
    call.unwrap_or(Call::Again)
}

/// How [`finish`] ends a transaction that wrote nothing.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum End {
    Commit,
    RollBack,
}

/// Ends a transaction that wrote nothing as `end` says, waiting at most `reply` (see
/// `deadline.rs`).
async fn finish(txn: DatabaseTransaction, end: End, row: &Row, reply: Duration) -> Result<()> {
    let ended = match end {
        End::Commit => within(reply, txn.commit()).await,
        End::RollBack => within(reply, txn.rollback()).await,
    };
    ended.map_err(|e| database("committing", row, e))
}
