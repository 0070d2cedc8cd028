//! The repositories bound to a section's transaction ([`TxRepository`], from
//! [`Tx::repository`]): the repository calls that make sense inside one transaction, all
//! through it.

use std::{marker::PhantomData, sync::Arc};

use sea_orm::{
    ActiveModelTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, IntoActiveModel, ModelTrait,
    QuerySelect, Select,
    sea_query::{IntoValueTuple, LockBehavior, LockType},
};

use crate::{
    db::{Bounded, deadline::Work, savepoint::Savepoint, txn::Txn},
    error::{Error, Result, database},
    outcome::{DeleteOutcome, GetOutcome, SaveOutcome},
    tx::{ForUpdate, Tx},
    write::row::{PrimaryKeyOf, Row, select_by_key},
    write::row_sql::{self as write, Inserted, built_from, keyed, saved_row},
    write::save::{Saved, insert_on, save_on},
};

/// Reads and writes of entity `E` in a section's transaction ([`Tx::repository`]): the
/// repository calls that make sense inside one transaction, all through it.
///
/// What they write reaches the session's cache only when the section commits: the stored rows
/// replace the cached ones, deleted rows are evicted. A section that rolls back leaves the cache
/// as it was.
pub struct TxRepository<'t, E> {
    tx: &'t Tx,
    entity: PhantomData<fn() -> E>,
}

impl Tx {
    /// A repository of `E` bound to this transaction.
    pub fn repository<E: EntityTrait>(&self) -> TxRepository<'_, E> {
        TxRepository {
            tx: self,
            entity: PhantomData,
        }
    }
}

impl<E> std::fmt::Debug for TxRepository<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxRepository").finish_non_exhaustive()
    }
}

impl<E> TxRepository<'_, E>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
    /// The row with primary key `id`, read through the transaction (never from the cache, which
    /// it does not change either). It is the snapshot a later [`save`](Self::save) of this
    /// section is checked against.
    ///
    /// # Errors
    /// [`Error::Database`] when the query fails; [`Error::InvalidKey`] for a malformed key.
    pub async fn load(&self, id: PrimaryKeyOf<E>) -> Result<Option<Arc<E::Model>>> {
        let row = Row::new::<E>(id.into_value_tuple())?;
        let found = select_by_key::<E>(row.pk())
            .one(self.tx)
            .await
            .map_err(|e| database("loading", &row, e))?;
        Ok(found.map(|model| {
            let model = Arc::new(model);
            self.tx.seen(&row.key, &model, false);
            model
        }))
    }

    /// The row with primary key `id`, read and locked until the section ends (`FOR UPDATE`, with
    /// `mode`'s behaviour toward a row another transaction has locked). The commit caches it.
    ///
    /// # Errors
    /// As [`load`](Self::load); with [`ForUpdate::NoWait`], a transient [`Error::Database`] when
    /// the row is locked.
    pub async fn load_locked(
        &self,
        id: PrimaryKeyOf<E>,
        mode: ForUpdate,
    ) -> Result<Option<Arc<E::Model>>> {
        let row = Row::new::<E>(id.into_value_tuple())?;
        self.load_row_locked(&row, mode).await
    }

    pub(crate) async fn load_row_locked(
        &self,
        row: &Row,
        mode: ForUpdate,
    ) -> Result<Option<Arc<E::Model>>> {
        let select = locking(
            select_by_key::<E>(row.pk()),
            self.tx.get_database_backend(),
            mode,
        );
        let found = read_locked(self.tx, mode, move |c| Box::pin(select.one(c)))
            .await
            .map_err(|e| database("loading", row, e))?;
        Ok(match found {
            Some(model) => {
                let model = Arc::new(model);
                self.tx.seen(&row.key, &model, true);
                Some(model)
            }
            None => {
                // With SKIP LOCKED, a locked row reads as missing: forget nothing then.
                if mode != ForUpdate::SkipLocked {
                    self.tx.gone(&row.key);
                }
                None
            }
        })
    }

    /// The rows `select` finds, read and locked until the section ends, as [`load_locked`]
    /// does: with [`ForUpdate::SkipLocked`] and a `limit`, "the next free rows" of a work queue.
    /// The commit caches them.
    ///
    /// [`load_locked`]: Self::load_locked
    ///
    /// # Errors
    /// As [`load_locked`](Self::load_locked).
    pub async fn find_locked(
        &self,
        select: Select<E>,
        mode: ForUpdate,
    ) -> Result<Vec<Arc<E::Model>>> {
        let table = E::default().table_name();
        let select = locking(select, self.tx.get_database_backend(), mode);
        let models = read_locked(self.tx, mode, move |c| Box::pin(select.all(c)))
            .await
            .map_err(|e| database("loading rows of", &table, e))?;
        models
            .into_iter()
            .map(|model| {
                let row = Row::new::<E>(model.get_primary_key_value())?;
                let model = Arc::new(model);
                self.tx.seen(&row.key, &model, true);
                Ok(model)
            })
            .collect()
    }

    /// Inserts a row in the transaction (with the `before_save` / `after_save` hooks, `insert =
    /// true`), returning what `after_save` returned; the commit caches the row as stored.
    ///
    /// # Errors
    /// [`Error::Database`] when the insert or a hook fails. A unique-key violation aborts the
    /// transaction on PostgreSQL: use [`get_or_insert`](Self::get_or_insert) when the row may
    /// exist.
    pub async fn insert(&self, model: E::ActiveModel) -> Result<Arc<E::Model>> {
        let (row, stored, reported) = insert_on::<E, _>(self.tx, model).await?;
        self.tx.seen(&row.key, &Arc::new(stored), true);
        Ok(Arc::new(reported))
    }

    /// The guarded save of [`crate::Repository::save`], in the transaction. Its snapshot is the
    /// row as this section last read or wrote it, else as the session has it cached. A
    /// [`SaveOutcome::Conflict`] makes a [retrying section](crate::Section::run_retrying) run
    /// again when it then returns an error.
    ///
    /// # Errors
    /// As [`crate::Repository::save`].
    pub async fn save(&self, model: E::ActiveModel) -> Result<SaveOutcome<E::Model>> {
        let row = saved_row::<E>(&model)?;
        let Some(snapshot) = self.tx.snapshot::<E::Model>(&row.key) else {
            return Err(Error::NoSnapshot {
                target: row.to_string(),
            });
        };
        if !built_from::<E>(&model, &snapshot) {
            self.tx.note_conflict();
            self.tx.gone(&row.key);
            return Ok(SaveOutcome::Conflict);
        }
        if !model.is_changed() {
            return Ok(SaveOutcome::Unchanged);
        }
        self.save_row(&row, &snapshot, model).await
    }

    /// The guarded save of `model` against `snapshot`, in the transaction.
    pub(crate) async fn save_row(
        &self,
        row: &Row,
        snapshot: &E::Model,
        model: E::ActiveModel,
    ) -> Result<SaveOutcome<E::Model>> {
        let version = self.tx.session.version_of::<E>();
        let saved = save_on::<E, _>(self.tx, row, snapshot, model, version, false).await?;
        Ok(match saved {
            Saved::Stored { stored, reported } => {
                self.tx.seen(&row.key, &Arc::new(stored), true);
                SaveOutcome::Updated(Arc::new(reported))
            }
            Saved::Holds(stored) => {
                self.tx.seen(&row.key, &Arc::new(stored), true);
                SaveOutcome::Unchanged
            }
            Saved::Conflict => {
                self.tx.note_conflict();
                self.tx.gone(&row.key);
                SaveOutcome::Conflict
            }
            Saved::NotFound => {
                self.tx.gone(&row.key);
                SaveOutcome::NotFound
            }
        })
    }

    /// Deletes the row with primary key `id` in the transaction: reads it locked, runs
    /// `before_delete`, deletes it (checking the version column when the entity has one), runs
    /// `after_delete`. The commit evicts it. The section's lock is what serializes it with other
    /// writers; [`DeleteOutcome::LeaseLost`] is never returned here (the section reports a lost
    /// lease for the whole transaction).
    ///
    /// # Errors
    /// [`Error::Database`] when a statement or a hook fails.
    pub async fn locked_delete(&self, id: PrimaryKeyOf<E>) -> Result<DeleteOutcome<E::Model>> {
        let row = Row::new::<E>(id.into_value_tuple())?;
        let Some(original) = self.load_row_locked(&row, ForUpdate::Wait).await? else {
            return Ok(DeleteOutcome::NotFound);
        };
        let expected = write::version_guard::<E>(self.tx.session.version_of::<E>(), &original);
        let deleted =
            write::delete_row::<E, _>(self.tx, &original, row.pk(), &expected, None, None)
                .await
                .map_err(|failed| database(failed.operation, &row, failed.error))?;
        // No lease sent with it: only `Deleted` or `Refused`.
        if deleted != write::Removed::Deleted {
            // Locked by us since the read: only a write outside every lock can get here.
            self.tx.note_conflict();
            self.tx.gone(&row.key);
            return Err(Error::Conflict {
                target: row.to_string(),
                attempts: 1,
            });
        }
        self.tx.gone(&row.key);
        Ok(DeleteOutcome::Deleted(original))
    }

    /// The row with primary key `id`, read locked, or created from `init` (with the insert
    /// hooks) when there is none; the `bool` says whether this call created it. A concurrent
    /// creator that wins the race (one outside the section's lock) is not an error: the insert
    /// runs in a savepoint, and the winner's row is returned.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when `init`'s primary key differs from `id`; [`Error::Database`].
    pub async fn get_or_insert(
        &self,
        id: PrimaryKeyOf<E>,
        init: impl FnOnce() -> E::ActiveModel + Send,
    ) -> Result<GetOutcome<E::Model>> {
        let row = Row::new::<E>(id.into_value_tuple())?;
        if let Some(found) = self.load_row_locked(&row, ForUpdate::Wait).await? {
            return Ok(GetOutcome::Found(found));
        }
        let draft = keyed::<E>(init(), row.pk())?;
        let target = &row;
        let fail = |operation| move |e| database(operation, target, e);
        // Each round trip bounded, as every statement of the section (see `deadline.rs`).
        let reply = self.tx.reply();
        let savepoint = Savepoint::begin(&self.tx.txn, reply)
            .await
            .map_err(fail("beginning a savepoint for"))?;
        let inserted = write::insert_row::<E, _>(&savepoint.bounded(), draft).await;
        let (stored, reported) = match inserted {
            Ok(Inserted::Stored { stored, reported }) => (stored, reported),
            Ok(Inserted::Taken(_)) => {
                savepoint
                    .roll_back()
                    .await
                    .map_err(fail("rolling back a savepoint for"))?;
                let found = self.load_row_locked(&row, ForUpdate::Wait).await?;
                return found.map(GetOutcome::Found).ok_or_else(|| Error::Conflict {
                    target: row.to_string(),
                    attempts: 1,
                });
            }
            Err(failed) => return Err(database(failed.operation, &row, failed.error)),
        };
        savepoint
            .release()
            .await
            .map_err(fail("releasing a savepoint for"))?;
        self.tx.seen(&row.key, &Arc::new(stored), true);
        Ok(GetOutcome::Created(Arc::new(reported)))
    }
}

/// Runs `read` — a SELECT locked in `mode` — on `tx`'s transaction, each round trip within its
/// reply bound. A `NOWAIT` read off SQLite runs in a savepoint, so that its failure on a locked
/// row does not abort the section's transaction (PostgreSQL would refuse every later
/// statement): the section can move on to another row.
async fn read_locked<T>(
    tx: &Tx,
    mode: ForUpdate,
    read: impl for<'c> FnOnce(&'c Bounded<'c, Txn>) -> Work<'c, T>,
) -> std::result::Result<T, DbErr> {
    let reply = tx.reply();
    if mode == ForUpdate::NoWait && tx.get_database_backend() != DbBackend::Sqlite {
        Savepoint::around(&tx.txn, reply, read).await
    } else {
        read(&Bounded::new(&tx.txn, reply)).await
    }
}

/// `select` with `FOR UPDATE` in `mode` — nothing on SQLite, where the section's `BEGIN
/// IMMEDIATE` already keeps every other writer out.
fn locking<E: EntityTrait>(select: Select<E>, backend: DbBackend, mode: ForUpdate) -> Select<E> {
    match (backend, mode) {
        (DbBackend::Sqlite, _) => select,
        (_, ForUpdate::Wait) => select.lock_exclusive(),
        (_, ForUpdate::NoWait) => select.lock_with_behavior(LockType::Update, LockBehavior::Nowait),
        (_, ForUpdate::SkipLocked) => {
            select.lock_with_behavior(LockType::Update, LockBehavior::SkipLocked)
        }
    }
}
