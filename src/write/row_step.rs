//! One row's locked write as a step of the engine (`engine.rs`): evict, reload under the lock,
//! hand the row to the caller, and write what it decided — update (serving the seated waiters of
//! a combined batch), insert or delete, with the hooks and the version guard of `row_sql/`. The
//! fence check, the commit with its evidence, the cache effects and the retries are the
//! engine's: this file only says what the attempt wrote.

use crate::write::entity::Writable;
use std::{sync::Arc, time::Duration};

use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, EntityTrait};
use tokio::sync::mpsc;
use tracing::debug;

use crate::{
    commit::{Evidence, Marker},
    db::deadline::{Bounded, within},
    error::{Error, Result, database},
    identity_map::Change,
    session::Session,
    write::decision::{Decision, Written},
    write::engine::{self, End, Fence, Step, Tried, Worked},
    write::locking::Locking,
    write::row::{Row, reload_for_update},
    write::row_sql::{self as write, Inserted, Removed},
    write::row_write::{self, Updated},
    write::{combine::Batch, room::RoomKey},
};

/// The row write of one `locked_update` (or delete, get-or-insert, update-or-insert), talking to
/// its caller over two channels: the reloaded row out, the caller's [`Decision`] back.
pub(crate) struct RowStep<E: EntityTrait> {
    pub(crate) session: Session,
    pub(crate) row: Row,
    pub(crate) reloaded: mpsc::Sender<Option<E::Model>>,
    pub(crate) decisions: mpsc::Receiver<Decision<E>>,
    /// The row's room when this write may share a commit (see [`crate::write::combine`]).
    pub(crate) room: Option<RoomKey>,
    /// The waiters this holder serves (taken on its first attempt that writes), when combining.
    pub(crate) batch: Option<Batch<E>>,
    /// How many writes the committed transaction carried (1 unless combined).
    pub(crate) committed: u32,
    /// What the served waiters are told once this attempt's transaction committed: the stored
    /// row and the rows their own `after_save` returned.
    telling: Option<Telling<E::Model>>,
    /// Whether the reload tries a `pg_advisory` or `row` lock itself (see
    /// `Locking::folding`): for writes that only update a row that exists, until a try
    /// fails.
    fold: bool,
    /// Whether the write only ever updates or keeps a row that exists (`locked_update`).
    updates_only: bool,
}

/// The stored row of a combined write and, by member index, the rows the served waiters' own
/// `after_save` returned.
type Telling<M> = (Arc<M>, Vec<(usize, M)>);

/// What an attempt of a row write gives the engine.
type Attempted<E> = (
    DatabaseTransaction,
    Worked<Written<<E as EntityTrait>::Model>>,
);

impl<E> RowStep<E>
where
    E: Writable,
{
    pub(crate) fn new(
        session: Session,
        row: Row,
        reloaded: mpsc::Sender<Option<E::Model>>,
        decisions: mpsc::Receiver<Decision<E>>,
        room: Option<RoomKey>,
        fold: bool,
    ) -> Self {
        Self {
            session,
            row,
            reloaded,
            decisions,
            room,
            batch: None,
            committed: 1,
            telling: None,
            fold,
            updates_only: fold,
        }
    }

    /// `before_save`, the waiters of the batch served (when combining), the fence check, the
    /// guarded UPDATE with its commit evidence, `after_save` (the holder's and each served
    /// waiter's).
    async fn update(
        &mut self,
        txn: DatabaseTransaction,
        lockings: &mut [Locking],
        original: E::Model,
        draft: E::ActiveModel,
    ) -> Attempted<E> {
        let bounded = Bounded::new(&txn, self.reply());
        let mut changes =
            match row_write::changes::<E, _>(&bounded, &self.row, &original, draft).await {
                Ok(changes) => changes,
                Err(error) => return (txn, Worked::Undone(Tried::failed(error))),
            };
        // Only a holder that excludes the process's other writers of the row may serve them.
        let excludes = lockings.iter().all(Locking::excludes_process);
        if let Some(room) = self.room.as_ref().filter(|_| excludes) {
            let batch = self.batch.get_or_insert_with(|| Batch::take(room));
            match batch
                .serve(&bounded, &original, &mut changes, &self.row)
                .await
            {
                Ok(true) => {}
                Ok(false) => return (txn, Worked::Undone(Tried::Uncounted)),
                Err(e) => return self.failed(txn, "combining writes of", e),
            }
        }
        if changes.is_empty() {
            let original = Arc::new(original);
            self.telling = Some((Arc::clone(&original), Vec::new()));
            let worked = Worked::Kept {
                effects: vec![self.cached(&original)],
                value: Written::Unchanged(original),
                end: End::Commit,
            };
            return (txn, worked);
        }
        // Checked before the UPDATE, so a lost lease sends none; the lease (table backend) is
        // released in this transaction: the commit ends it. On MySQL/MariaDB a single `table`
        // lease's check-and-free rides in the UPDATE's message instead (one round trip less):
        // the write stands only where it found the lease held.
        let markers = self.session.commit_markers();
        let riding = Locking::riding_write(lockings, txn.get_database_backend(), markers);
        if riding.is_none()
            && let Some(refused) = self.fence(&txn, lockings).await
        {
            return (txn, refused);
        }
        // The optimistic guard and the UPDATE (see `row_write.rs`), with the evidence a lost
        // commit reply is resolved with, taken by the UPDATE's own statement where the
        // database allows (see `commit/`).
        let sending = write::Sending {
            db: self.session.pool(),
            markers,
            reply: self.reply(),
            lease: riding,
        };
        let version = self.session.version_of::<E>();
        let updated =
            row_write::update::<E>(&txn, &self.row, version, &original, changes, sending).await;
        // Freed by this transaction when the write went through; after a failure the lease is
        // checked by a statement of its own in the next attempt.
        let rode = matches!(updated, Ok(Updated::Stored(..) | Updated::Refused));
        Locking::rode(lockings, rode);
        let (stored, evidence) = match updated {
            Ok(Updated::Stored(stored, evidence)) => (stored, evidence),
            Ok(Updated::Refused) => {
                let conflict = Tried::conflict(self.row.to_string());
                return (txn, Worked::Undone(conflict));
            }
            Ok(Updated::LeaseNotConfirmed) => return (txn, Worked::Undone(Tried::Uncounted)),
            Err(error) => return (txn, Worked::Undone(Tried::failed(error))),
        };
        let bounded = Bounded::new(&txn, self.reply());
        let reported = match write::after_save::<E, _>(stored.clone(), &bounded, false).await {
            Ok(reported) => reported,
            Err(e) => return self.failed(txn, "running after_save for", e),
        };
        // Each served waiter that changed something gets its own `after_save`.
        let theirs = match self.batch.as_mut() {
            None => Vec::new(),
            Some(batch) => match batch.after_saves(&stored, &bounded, &self.row).await {
                Some(theirs) => theirs,
                None => return (txn, Worked::Undone(Tried::Uncounted)),
            },
        };
        let stored = Arc::new(stored);
        self.telling = Some((Arc::clone(&stored), theirs));
        let worked = Worked::Write {
            value: Written::Updated(Arc::new(reported)),
            evidence,
            fence: Fence::Checked,
            effects: vec![self.cached(&stored)],
        };
        (txn, worked)
    }

    /// `before_save`, INSERT … RETURNING, `after_save`. No fence check: an insert cannot
    /// overwrite anything, and a concurrent creator makes it fail on the key (a conflict: the
    /// next attempt finds the winner's row).
    async fn insert(&self, txn: DatabaseTransaction, draft: E::ActiveModel) -> Attempted<E> {
        let inserted = write::insert_row::<E, _>(&Bounded::new(&txn, self.reply()), draft).await;
        let worked = match inserted {
            Ok(Inserted::Stored { stored, reported }) => Worked::Write {
                value: Written::Inserted(Arc::new(reported)),
                evidence: None,
                fence: Fence::Unchecked,
                effects: vec![self.cached(&Arc::new(stored))],
            },
            Ok(Inserted::Taken(_)) => Worked::Undone(Tried::conflict(self.row.to_string())),
            Err(failed) => return self.failed(txn, failed.operation, failed.error),
        };
        (txn, worked)
    }

    /// The fence check (which frees a `table` lease in this transaction, as an update's does:
    /// the commit ends it; on MySQL/MariaDB sent with the DELETE, as an update's with its
    /// UPDATE), `before_delete`, DELETE (guarded by the version column when one is declared),
    /// `after_delete`; the commit evicts the row.
    async fn delete(
        &self,
        txn: DatabaseTransaction,
        lockings: &mut [Locking],
        original: E::Model,
    ) -> Attempted<E> {
        // On MySQL/MariaDB the commit marker goes with the DELETE (one round trip less than a
        // marker's INSERT before `COMMIT`), and a single `table` lease's check-and-free with
        // them, as an update's; elsewhere the engine takes the evidence at the commit.
        let backend = txn.get_database_backend();
        let marker =
            (backend == DbBackend::MySql && self.session.commit_markers()).then(Marker::new);
        let riding = Locking::riding_write(lockings, backend, marker.is_some());
        if riding.is_none()
            && let Some(refused) = self.fence(&txn, lockings).await
        {
            return (txn, refused);
        }
        let expected = write::version_guard::<E>(self.session.version_of::<E>(), &original);
        let pk = self.row.pk();
        let bounded = Bounded::new(&txn, self.reply());
        let deleted =
            write::delete_row::<E, _>(&bounded, &original, pk, &expected, marker.as_ref(), riding)
                .await;
        let held = matches!(deleted, Ok(Removed::Deleted | Removed::Refused));
        Locking::rode(lockings, held);
        let worked = match deleted {
            Ok(Removed::Deleted) => Worked::Write {
                value: Written::Deleted(Arc::new(original)),
                evidence: marker.map(Evidence::Marker),
                fence: Fence::Checked,
                effects: vec![Change::Evict(self.row.key.clone())],
            },
            Ok(Removed::Refused) => Worked::Undone(Tried::conflict(self.row.to_string())),
            Ok(Removed::LeaseNotConfirmed) => {
                debug!(row = %self.row.name, "the lease's check in the DELETE's message did not confirm it; again, checked on its own");
                Worked::Undone(Tried::Uncounted)
            }
            Err(failed) => return self.failed(txn, failed.operation, failed.error),
        };
        (txn, worked)
    }

    /// The fence check before the write (see [`engine::fences`]): `Some` with how the attempt
    /// ends when the lease is lost or cannot be checked, so that no write is sent.
    async fn fence(
        &self,
        txn: &DatabaseTransaction,
        lockings: &mut [Locking],
    ) -> Option<Worked<Written<E::Model>>> {
        match engine::fences(txn, lockings, self.row.name.as_str()).await {
            Ok(true) => None,
            Ok(false) => Some(Worked::Undone(Tried::Done(Written::LeaseLost))),
            Err(error) => Some(Worked::Undone(Tried::failed(error))),
        }
    }

    /// The cache change that records `model` as this row's committed state.
    fn cached(&self, model: &Arc<E::Model>) -> Change {
        Change::cache(self.row.key.clone(), Arc::clone(model))
    }

    /// A step of the write failed: the engine rolls back, and this is the error.
    fn failed(&self, txn: DatabaseTransaction, operation: &'static str, e: DbErr) -> Attempted<E> {
        let error = database(operation, &self.row, e);
        (txn, Worked::Undone(Tried::failed(error)))
    }

    /// The bound on each round trip of this write (see `deadline.rs`).
    fn reply(&self) -> Duration {
        self.session.policy().reply_deadline()
    }

    /// What the served waiters of a combined write are told once its transaction committed
    /// (see [`Step::ended`]): the stored row and the rows their own `after_save` returned.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn tell(&mut self, stored: Arc<E::Model>, theirs: Vec<(usize, E::Model)>) {
        self.telling = Some((stored, theirs));
    }

    /// The lock is not to be tried by the reload any more (a try in two flights failed).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn unfold(&mut self) {
        self.fold = false;
    }

    /// Whether the write only ever updates or keeps a row that exists (`locked_update`: no
    /// insert, no delete).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn updates_only(&self) -> bool {
        self.updates_only
    }

    pub(crate) fn interrupted(&self) -> Error {
        Error::Interrupted {
            target: self.row.to_string(),
        }
    }
}

impl<E> Step for RowStep<E>
where
    E: Writable,
{
    type Output = Written<E::Model>;

    /// Evict, reload, hand over to the caller, write what it decided.
    async fn run(&mut self, txn: DatabaseTransaction, lockings: &mut [Locking]) -> Attempted<E> {
        self.telling = None;
        self.session.map().remove(&self.row.key);
        let folded = lockings.first().and_then(Locking::folding);
        let folds = folded.is_some();
        let started = tokio::time::Instant::now();
        let reload = reload_for_update::<E>(&txn, self.row.pk(), folded);
        let found = match within(self.reply(), reload).await {
            Ok(found) => found,
            Err(e) => return self.failed(txn, "reloading", e),
        };
        if folds {
            let held = found.is_some();
            if let Some(locking) = lockings.first_mut() {
                locking.folded(held, started.elapsed());
            }
            if !held {
                // The lock is busy (or there is no row, which the statement cannot tell apart):
                // nothing was read or locked. Again, the lock taken by a statement of its own.
                self.fold = false;
                return (txn, Worked::Undone(Tried::Uncounted));
            }
        }
        // A caller that is gone or aborted closed its channel: roll back, and report (to
        // nobody, or to a caller that returns its own error instead).
        if self.reloaded.send(found).await.is_err() {
            return (txn, Worked::Undone(Tried::failed(self.interrupted())));
        }
        let Some(decision) = self.decisions.recv().await else {
            return (txn, Worked::Undone(Tried::failed(self.interrupted())));
        };
        match decision {
            Decision::NotFound => {
                let worked = Worked::Kept {
                    value: Written::NotFound,
                    end: End::RollBack,
                    effects: Vec::new(),
                };
                (txn, worked)
            }
            Decision::Keep(original) => {
                debug!(row = %self.row.name, "unchanged");
                let original = Arc::new(original);
                let worked = Worked::Kept {
                    effects: vec![self.cached(&original)],
                    value: Written::Unchanged(original),
                    end: End::Commit,
                };
                (txn, worked)
            }
            Decision::Update { original, draft } => {
                self.update(txn, lockings, original, draft).await
            }
            Decision::Insert(draft) => self.insert(txn, draft).await,
            Decision::Delete(original) => self.delete(txn, lockings, original).await,
        }
    }

    fn lease_lost(&mut self) -> Written<E::Model> {
        Written::LeaseLost
    }

    fn folds_lock(&self) -> bool {
        self.fold
    }

    /// After the commit, every waiter merged into it gets its report (see
    /// [`Batch::committed`]); after a commit whose outcome is unknown, each is told so.
    fn ended(&mut self, lockings: &[Locking], ended: &Result<()>) {
        let (Some(batch), Some((stored, theirs))) = (self.batch.as_mut(), self.telling.take())
        else {
            return;
        };
        match (ended, lockings.first()) {
            (Ok(()), Some(locking)) => {
                self.committed = batch.committed(&locking.report, &stored, theirs);
            }
            (Err(Error::CommitUnknown { source, .. }), _) => {
                batch.in_doubt(&self.row, &source.to_string());
            }
            _ => {}
        }
    }
}
