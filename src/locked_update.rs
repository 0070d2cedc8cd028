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
//! Retries, the fence check and the release are the engine's (`engine.rs`), the row write steps
//! `write.rs`'s, the combining protocol `combine.rs`'s: the driver only orders them.

use std::{
    any::TypeId,
    panic::{AssertUnwindSafe, catch_unwind, resume_unwind},
    sync::Arc,
    time::Duration,
};

use sea_orm::{DatabaseTransaction, DbErr, EntityTrait, IdenStatic, IntoActiveModel, ModelTrait};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, field, info_span};

pub(crate) use crate::decision::{Decision, Written};
use crate::{
    combine::{self, Batch, Call, Followed, RoomKey, Seat, Served},
    commit,
    deadline::within,
    detach::Detachable,
    engine::{self, End, Retries, Tried, finish},
    error::{Error, Result, database},
    identity_map::Change,
    locking::Locking,
    outcome::Report,
    row::{Row, reload_for_update},
    session::Session,
    write::{self, Inserted},
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
        backend = session.lock_backend().kind().as_str(),
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

/// The task that owns the lock and the transaction of one locked write.
struct Driver<E: EntityTrait> {
    session: Session,
    row: Row,
    reloaded: mpsc::Sender<Option<E::Model>>,
    decisions: mpsc::Receiver<Decision<E>>,
    /// The row's room when this write may share a commit (see [`crate::combine`]).
    room: Option<RoomKey>,
    /// The waiters this holder serves (taken on its first attempt that writes), when combining.
    batch: Option<Batch<E>>,
    /// How many writes the committed transaction carried (1 unless combined).
    committed: u32,
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
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
    /// Runs the section and records how it ended (see [`engine::record`]).
    async fn run(self) -> Result<Report<Written<E::Model>>> {
        let result = self.run_locked().await;
        engine::record(E::default().table_name(), &result);
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
                None => return Err(self.interrupted()), // The caller gave up while we waited.
            }
        };
        let mut retries = Retries::new(
            self.row.to_string(),
            policy.write_attempts,
            true,
            Some(E::default().table_name()),
        );
        let result = loop {
            retries.start();
            let tried = self.section(&mut locking).await;
            if let Some(result) = retries.settle(tried).await {
                break result;
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
            attempts: retries.attempts,
            conflicts: retries.conflicts,
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

    /// A seated waiter follows the holder that took its seat (see [`combine::follow`]):
    /// `None` when it was not served and must take the lock itself.
    async fn follow(
        &mut self,
        first: Option<Call<E>>,
        calls: &mut mpsc::UnboundedReceiver<Call<E>>,
        started: tokio::time::Instant,
    ) -> Option<Result<Report<Written<E::Model>>>> {
        let (session, key) = (&self.session, &self.row.key);
        let evict = || {
            session.map().remove(key);
        };
        let followed =
            combine::follow(first, calls, &self.reloaded, &mut self.decisions, evict).await;
        match followed {
            Followed::Again => None,
            Followed::Gone => Some(Err(self.interrupted())),
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
            let changes = [Change::cache(self.row.key.clone(), stored)];
            self.session.map().apply(changes);
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
    async fn section(&mut self, locking: &mut Locking) -> Result<Tried<Written<E::Model>>> {
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
                Ok(Tried::Done(Written::NotFound))
            }
            Decision::Keep(original) => {
                finish(txn, End::Commit, &self.row, self.reply()).await?;
                debug!(row = %self.row.name, "unchanged");
                Ok(Tried::Done(Written::Unchanged(self.cache(original))))
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
    ) -> Result<Tried<Written<E::Model>>> {
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
        if let Some(room) = self.room.as_ref().filter(|_| locking.excludes_process()) {
            let batch = self.batch.get_or_insert_with(|| Batch::take(room));
            match batch.serve(&txn, &original, &mut changes, &self.row).await {
                Ok(true) => {}
                Ok(false) => {
                    let _ = txn.rollback().await;
                    return Ok(Tried::Uncounted);
                }
                Err(e) => return Err(self.rolled_back(txn, "combining writes of", e).await),
            }
        }
        if changes.is_empty() {
            finish(txn, End::Commit, &self.row, self.reply()).await?;
            let row = self.cache(original);
            self.tell_committed(locking, &row, Vec::new());
            return Ok(Tried::Done(Written::Unchanged(row)));
        }
        // The lease (table backend) is released in this transaction: the commit ends it.
        if !engine::fence(&txn, locking, true, self.row.name.as_str()).await? {
            let _ = txn.rollback().await;
            return Ok(Tried::Done(Written::LeaseLost));
        }
        // The optimistic guard: the UPDATE also checks that the row still holds what was read
        // (its version column when one is declared, else the changed columns), so a write made
        // without the lock can never overwrite a change it did not see.
        let version = self.session.version_of::<E>();
        let read = version.map(|column| (column, original.get(column)));
        let unversioned = |changes: &[write::ColumnValue<E>]| {
            (changes.iter())
                .map(|(column, _)| (*column, original.get(*column)))
                .collect()
        };
        let Some(expected) = write::guard::<E>(read, &mut changes, unversioned) else {
            let _ = txn.rollback().await;
            return Err(Error::VersionColumn {
                entity: E::default().table_name(),
                column: version.map_or("", |c| c.as_str()),
            });
        };
        // The evidence a lost commit reply is resolved with, taken by the UPDATE's own
        // statement where the database allows (see `commit.rs`).
        let (db, reply) = (self.session.connection(), self.reply());
        let markers = self.session.commit_markers();
        let update = write::update_with_evidence::<E>(
            &txn, db, markers, &original, &changes, &expected, reply,
        );
        let (written, evidence) = match update.await {
            Ok((written, evidence)) => (Ok(written), evidence),
            Err((write::Step::Evidence, e)) => {
                return Err(self.rolled_back(txn, "marking the commit of", e).await);
            }
            Err((write::Step::Update, e)) => (Err(e), None),
        };
        let stored = match written {
            Ok(Some(stored)) => stored,
            Ok(None) => {
                finish(txn, End::RollBack, &self.row, self.reply()).await?;
                return Ok(Tried::conflict(self.row.to_string()));
            }
            Err(e) => return Err(self.rolled_back(txn, "writing", e).await),
        };
        let reported = match write::after_save::<E, _>(stored.clone(), &txn, false).await {
            Ok(reported) => reported,
            Err(e) => return Err(self.rolled_back(txn, "running after_save for", e).await),
        };
        // Each served waiter that changed something gets its own `after_save`.
        let theirs = match self.batch.as_mut() {
            None => Vec::new(),
            Some(batch) => match batch.after_saves(&stored, &txn, &self.row).await {
                Some(theirs) => theirs,
                None => {
                    let _ = txn.rollback().await;
                    return Ok(Tried::Uncounted);
                }
            },
        };
        let target = self.row.name.as_str();
        let committed = match &evidence {
            Some(evidence) => commit::commit(txn, evidence, db, target, reply).await,
            None => commit::commit_write(txn, false, db, target, reply).await,
        };
        if committed.is_ok() {
            locking.committed();
        }
        if let Err(error) = committed {
            if let (Error::CommitUnknown { source, .. }, Some(batch)) = (&error, &mut self.batch) {
                batch.in_doubt(&self.row, &source.to_string());
            }
            return Err(error);
        }
        let stored = self.cache(stored);
        self.tell_committed(locking, &stored, theirs);
        debug!(row = %self.row.name, batch = self.committed, "updated");
        Ok(Tried::Done(Written::Updated(Arc::new(reported))))
    }

    /// After the commit: every waiter merged into it gets its report (see
    /// [`Batch::committed`]).
    fn tell_committed(
        &mut self,
        locking: &Locking,
        stored: &Arc<E::Model>,
        theirs: Vec<(usize, E::Model)>,
    ) {
        if let Some(batch) = self.batch.as_mut() {
            self.committed = batch.committed(&locking.report, stored, theirs);
        }
    }

    /// `before_save`, INSERT … RETURNING, `after_save`, commit. No fence check: an insert cannot
    /// overwrite anything, and a concurrent creator makes it fail on the key (a conflict: the
    /// next attempt finds the winner's row).
    async fn insert(
        &self,
        txn: DatabaseTransaction,
        draft: E::ActiveModel,
    ) -> Result<Tried<Written<E::Model>>> {
        let (stored, reported) = match write::insert_row::<E, _>(&txn, draft).await {
            Ok(Inserted::Stored { stored, reported }) => (stored, reported),
            Ok(Inserted::Taken(_)) => {
                finish(txn, End::RollBack, &self.row, self.reply()).await?;
                return Ok(Tried::conflict(self.row.to_string()));
            }
            Err(failed) => return Err(self.failed(txn, failed).await),
        };
        self.commit(txn).await?;
        self.cache(stored);
        debug!(row = %self.row.name, "inserted");
        Ok(Tried::Done(Written::Inserted(Arc::new(reported))))
    }

    /// Fence, `before_delete`, DELETE (guarded by the version column when one is declared),
    /// `after_delete`, commit, evict.
    async fn delete(
        &self,
        txn: DatabaseTransaction,
        locking: &mut Locking,
        original: E::Model,
    ) -> Result<Tried<Written<E::Model>>> {
        if !engine::fence(&txn, locking, false, self.row.name.as_str()).await? {
            let _ = txn.rollback().await;
            return Ok(Tried::Done(Written::LeaseLost));
        }
        let expected = write::version_guard::<E>(self.session.version_of::<E>(), &original);
        match write::delete_row::<E, _>(&txn, &original, self.row.pk(), &expected).await {
            Ok(true) => {}
            Ok(false) => {
                finish(txn, End::RollBack, &self.row, self.reply()).await?;
                return Ok(Tried::conflict(self.row.to_string()));
            }
            Err(failed) => return Err(self.failed(txn, failed).await),
        }
        self.commit(txn).await?;
        self.session
            .map()
            .apply([Change::Evict(self.row.key.clone())]);
        debug!(row = %self.row.name, "deleted");
        Ok(Tried::Done(Written::Deleted(Arc::new(original))))
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

    /// Caches `model` as this row's committed state (its write committed, or wrote nothing).
    fn cache(&self, model: E::Model) -> Arc<E::Model> {
        let model = Arc::new(model);
        let changes = [Change::cache(self.row.key.clone(), Arc::clone(&model))];
        self.session.map().apply(changes);
        model
    }

    /// The caller is gone or aborted: roll back, and report (to nobody, or to a caller that
    /// returns its own error instead).
    async fn abandoned(&self, txn: DatabaseTransaction) -> Error {
        commit::rollback(txn, self.reply()).await;
        self.interrupted()
    }

    /// A step of the row write failed: roll back, and the error.
    async fn failed(&self, txn: DatabaseTransaction, failed: write::Failed) -> Error {
        self.rolled_back(txn, failed.operation, failed.error).await
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
