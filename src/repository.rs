//! Cached reads and dirty-only writes of one entity type.

use std::{any::TypeId, collections::HashMap, marker::PhantomData, sync::Arc};

use sea_orm::{
    ActiveModelTrait, ActiveValue, ColumnTrait, Condition, ConnectionTrait, DbBackend, EntityTrait,
    IdenStatic, IntoActiveModel, Iterable, ModelTrait, PrimaryKeyToColumn, QueryFilter,
    sea_query::{IntoValueTuple, ValueTuple},
};

use crate::{
    commit,
    decision::{Decision, Written},
    error::{ApplyError, Error, Result, database},
    identity_map::{Key, PkKey},
    live::on_live_connection,
    lock::LockName,
    locked_update,
    locking::begin,
    outcome::{DeleteOutcome, DeleteReport, SaveOutcome, UpdateOutcome, UpdateReport},
    pool::{autocommit, transaction_pooled},
    row::{Row, cache_key, select_by_key},
    session::Session,
    write,
};

pub use crate::row::PrimaryKeyOf;

/// Parameters in one `IN (…)` query of [`Repository::load_many`]: below every engine's limit
/// (SQLite 32766, PostgreSQL and MySQL 65535).
const MAX_PARAMS_PER_QUERY: usize = 30_000;

/// Reads and writes of entity `E` through a [`Session`]: the identity map on reads, dirty columns
/// only on writes, and [`locked_update`](Self::locked_update) for read-modify-write.
///
/// Works for any plain sea-orm entity. Cheap to clone.
#[derive(Debug)]
pub struct Repository<E> {
    session: Session,
    entity: PhantomData<fn() -> E>,
}

impl<E> Clone for Repository<E> {
    fn clone(&self) -> Self {
        Self::new(self.session.clone())
    }
}

// Defined here, not in `session.rs`: the session sits below its repositories and does not
// import them.
impl Session {
    /// The repository of entity `E`. Any sea-orm entity works; nothing needs to be implemented.
    pub fn repository<E: EntityTrait>(&self) -> Repository<E> {
        Repository::new(self.clone())
    }
}

impl<E> Repository<E> {
    pub(crate) fn new(session: Session) -> Self {
        Self {
            session,
            entity: PhantomData,
        }
    }

    /// The session this repository belongs to.
    pub fn session(&self) -> &Session {
        &self.session
    }
}

impl<E> Repository<E>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
    /// The row with primary key `id`, from the identity map when it is there; otherwise read
    /// from the database (the session's [read replica](crate::SessionBuilder::read_from), if it
    /// has one) and cached. A second load of the same id sends no SQL.
    ///
    /// The cached model is a snapshot: it does not see what others wrote since. Never base a
    /// write on it — [`locked_update`](Self::locked_update) reloads under the lock.
    ///
    /// # Errors
    /// [`Error::Database`] when the query fails; [`Error::InvalidKey`] for a malformed key.
    pub async fn load(&self, id: PrimaryKeyOf<E>) -> Result<Option<Arc<E::Model>>> {
        let key = cache_key::<E>(id.into_value_tuple())?;
        if let Some(model) = self.session.map().get::<E::Model>(&key) {
            return Ok(Some(model));
        }
        self.fetch(Row::new::<E>(key.1.to_tuple())?, false).await
    }

    /// The row with primary key `id`, always read from the database — the primary, also in a
    /// session that [reads from a replica](crate::SessionBuilder::read_from) — and the cache is
    /// refreshed with what was read, or forgets the row when it is gone.
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub async fn load_fresh(&self, id: PrimaryKeyOf<E>) -> Result<Option<Arc<E::Model>>> {
        let row = Row::new::<E>(id.into_value_tuple())?;
        self.fetch(row, true).await
    }

    /// Reads `row` — from the primary when `fresh`, else from the session's reader (its read
    /// replica, if any) — and caches what was read.
    async fn fetch(&self, row: Row, fresh: bool) -> Result<Option<Arc<E::Model>>> {
        let db = if fresh {
            self.session.connection()
        } else {
            self.session.reader()
        };
        let reader = autocommit(db);
        let found = on_live_connection(db, || select_by_key::<E>(row.pk()).one(&reader))
            .await
            .map_err(|e| database("loading", &row, e))?;
        Ok(match found {
            Some(model) => {
                let model = Arc::new(model);
                self.session.map().insert(row.key, Arc::clone(&model));
                Some(model)
            }
            None => {
                self.session.map().remove(&row.key);
                None
            }
        })
    }

    /// The rows with the given ids, in the order given (`None` for ids with no row). Cached rows
    /// are taken from the identity map; all the others are read in one query (split only past
    /// 30,000 parameters) and cached.
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub async fn load_many(
        &self,
        ids: impl IntoIterator<Item = PrimaryKeyOf<E>>,
    ) -> Result<Vec<Option<Arc<E::Model>>>> {
        let mut found = Vec::new();
        let mut missing: Vec<(usize, Key)> = Vec::new();
        for (i, id) in ids.into_iter().enumerate() {
            let key = cache_key::<E>(id.into_value_tuple())?;
            let cached = self.session.map().get::<E::Model>(&key);
            if cached.is_none() {
                missing.push((i, key));
            }
            found.push(cached);
        }
        let table = E::default().table_name();
        let columns = E::PrimaryKey::iter().count().max(1);
        for chunk in missing.chunks(MAX_PARAMS_PER_QUERY / columns) {
            let select = E::find().filter(any_of_keys::<E>(
                chunk.iter().map(|(_, key)| key.1.to_tuple()),
            ));
            let pool = self.session.reader();
            let reader = autocommit(pool);
            let models = on_live_connection(pool, || select.clone().all(&reader))
                .await
                .map_err(|e| database("loading many rows of", &table, e))?;
            let by_key: HashMap<PkKey, Arc<E::Model>> = models
                .into_iter()
                .map(|model| (model.get_primary_key_value().into(), Arc::new(model)))
                .collect();
            for (i, key) in chunk {
                // The same id asked twice gets the same Arc.
                if let Some(model) = by_key.get(&key.1) {
                    self.session.map().insert(key.clone(), Arc::clone(model));
                    found[*i] = Some(Arc::clone(model));
                }
            }
        }
        Ok(found)
    }

    /// Forgets the cached rows with these ids (Drupal's `resetCache([$id])`); returns how many
    /// were cached.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a malformed key.
    pub fn reset_cache(&self, ids: impl IntoIterator<Item = PrimaryKeyOf<E>>) -> Result<usize> {
        let mut removed = 0;
        for id in ids {
            let key = cache_key::<E>(id.into_value_tuple())?;
            removed += usize::from(self.session.map().remove(&key));
        }
        Ok(removed)
    }

    /// Forgets every cached row of this entity (Drupal's `resetCache()`); returns how many there were.
    pub fn reset_cache_all(&self) -> usize {
        self.session.forget_entity(TypeId::of::<E>())
    }

    /// Inserts a row and caches it as the database stored it (`RETURNING`, or a read back on
    /// MySQL/MariaDB). Runs the entity's `before_save` / `after_save` hooks (`insert = true`), as
    /// sea-orm's `ActiveModel::insert` does; returns what `after_save` returned.
    ///
    /// # Errors
    /// [`Error::Database`] when the insert or a hook fails (a unique-key violation included:
    /// use [`get_or_insert`](Self::get_or_insert) when another writer may create the row).
    pub async fn insert(&self, model: E::ActiveModel) -> Result<Arc<E::Model>> {
        let (row, stored, reported) =
            insert_on::<E, _>(&autocommit(self.session.connection()), model).await?;
        self.session.map().insert(row.key, Arc::new(stored));
        Ok(Arc::new(reported))
    }

    /// Writes the columns `model` sets, checked against the snapshot this session holds of the
    /// row, in one statement: the optimistic write.
    ///
    /// The snapshot is the row as this session has it cached (what [`load`](Self::load) returned,
    /// or what the last write through this session stored). The UPDATE's `WHERE` checks that the
    /// row still holds the snapshot's value of every column `model` sets — or, when the entity
    /// has a [version column](crate::SessionBuilder::version_column), that the version is still
    /// the one `model` carries (the version is then incremented). So a save based on a stale
    /// snapshot can never overwrite a newer write: it returns [`SaveOutcome::Conflict`], writes
    /// nothing and evicts the cached row. `model`'s `Unchanged` columns must also agree with the
    /// snapshot, or the save is a conflict too (the model was built from an older copy).
    ///
    /// Only columns set to a value other than the snapshot's are written; when there are none,
    /// one `SELECT` checks that the row still holds what was set, so [`SaveOutcome::Unchanged`]
    /// is never an assumption based on the cache. With nothing set at all, no SQL is sent.
    ///
    /// The entity's `before_save` / `after_save` hooks run (`insert = false`), as in sea-orm's
    /// `ActiveModel::update`: columns `before_save` sets are written and checked like the
    /// caller's. The cache and [`SaveOutcome::Updated`] hold the row as the database stored it
    /// (`RETURNING`; on MySQL/MariaDB, UPDATE and a read back in one transaction).
    ///
    /// # Errors
    /// - [`Error::InvalidKey`] when the primary key is not set, or a primary-key column is `Set`
    ///   (a save identifies its row by the key: keep it `Unchanged`, as `into_active_model`
    ///   does).
    /// - [`Error::NoSnapshot`] when this session has no snapshot of the row: load it first.
    /// - [`Error::VersionColumn`] when the version is NULL.
    /// - [`Error::Database`] when a statement or a hook fails.
    pub async fn save(&self, model: E::ActiveModel) -> Result<SaveOutcome<E::Model>> {
        let row = saved_row::<E>(&model)?;
        let Some(snapshot) = self.session.map().get::<E::Model>(&row.key) else {
            return Err(Error::NoSnapshot {
                target: row.to_string(),
            });
        };
        if !built_from::<E>(&model, &snapshot) {
            self.session.map().remove(&row.key);
            return Ok(SaveOutcome::Conflict);
        }
        self.save_against(row, &snapshot, model).await
    }

    /// [`save`](Self::save) of `model`, built from `snapshot` (the row as this session read it).
    async fn save_against(
        &self,
        row: Row,
        snapshot: &E::Model,
        model: E::ActiveModel,
    ) -> Result<SaveOutcome<E::Model>> {
        if !model.is_changed() {
            return Ok(SaveOutcome::Unchanged);
        }
        let version = self
            .session
            .version_column(TypeId::of::<E>())
            .and_then(write::column_named::<E>);
        let db = self.session.connection();
        let saved = if db.get_database_backend() == DbBackend::MySql || transaction_pooled(db) {
            // MySQL: no UPDATE … RETURNING, and the read back must see this UPDATE's row, not a
            // later one. Behind a transaction pooler: the UPDATE and a conflict's check read
            // must not run outside a transaction (see `transaction_pooler.rs`).
            let txn = begin(db).await.map_err(|e| database("saving", &row, e))?;
            let saved = save_on::<E, _>(&txn, &row, snapshot, model, version, false).await;
            match saved {
                Ok(saved) => {
                    txn.commit()
                        .await
                        .map_err(|e| commit::write_error("committing", row.name.as_str(), e))?;
                    Ok(saved)
                }
                Err(error) => {
                    let _ = txn.rollback().await;
                    Err(error)
                }
            }
        } else {
            save_on::<E, _>(db, &row, snapshot, model, version, true).await
        }?;
        Ok(match saved {
            Saved::Stored { stored, reported } => {
                self.session.map().insert(row.key, Arc::new(stored));
                SaveOutcome::Updated(Arc::new(reported))
            }
            Saved::Holds(stored) => {
                self.session.map().insert(row.key, Arc::new(stored));
                SaveOutcome::Unchanged
            }
            Saved::Conflict => {
                self.session.map().remove(&row.key);
                SaveOutcome::Conflict
            }
            Saved::NotFound => {
                self.session.map().remove(&row.key);
                SaveOutcome::NotFound
            }
        })
    }

    /// Read-modify-write of one row that never overwrites a concurrent writer's columns.
    ///
    /// In order: takes the lock for this row under the session's [`crate::LockPolicy`] → evicts
    /// the cached row → opens a transaction (`BEGIN IMMEDIATE` on SQLite, `READ COMMITTED` on
    /// PostgreSQL and MySQL) → reloads the row through it (`FOR UPDATE` on PostgreSQL and MySQL) →
    /// runs `apply` on it → runs the entity's `before_save` hook → writes only the columns that
    /// changed (nothing, and no hook, when `apply` changed none), `RETURNING` the stored row →
    /// runs `after_save` → commits → caches the stored row → releases the lock.
    ///
    /// `apply` is a synchronous closure that sets columns on the freshly read row; it may return
    /// an error (any error converts with `?`) to abort without writing. It is `FnMut` because it
    /// may be run again on a retry, so keep it free of side effects other than setting columns.
    /// Do the heavy work *before* calling this; the lock is held only for the reload and write.
    ///
    /// Hooks run inside the attempt's transaction (what they write through the connection they
    /// are given commits or rolls back with it), once per attempt that has something to write:
    /// a retried attempt runs them again.
    ///
    /// A missing row is the outcome [`crate::UpdateOutcome::NotFound`], not an error.
    ///
    /// # Errors
    /// - [`Error::Apply`] when `apply` returned an error; nothing was written.
    /// - [`Error::PrimaryKeyChanged`] when `apply` or `before_save` changed a primary-key column.
    /// - [`Error::LockNotAcquired`] / [`Error::Lock`] when the lock could not be had and the
    ///   policy says to fail.
    /// - [`Error::Conflict`] when the optimistic guard refused every attempt.
    /// - [`Error::Database`] when a statement or a hook failed; the transaction was rolled back.
    ///
    /// In every error case, and when `apply` panics (the panic is resumed in the caller after the
    /// rollback), the transaction is rolled back, the cache holds no half-applied row and the lock
    /// is released.
    ///
    /// # Cancel safety
    /// The locked section is polled in place, and moved to a task of its own when this future is
    /// dropped, so a drop never interrupts a statement halfway (which would make the driver close
    /// the connection — with in-memory SQLite, destroying the database). If the future is dropped
    /// before `apply` has returned, the section rolls back; if it is dropped after, the write still
    /// commits and the cache is updated. Either way the lock is released after the transaction
    /// has ended.
    pub async fn locked_update<F>(
        &self,
        id: PrimaryKeyOf<E>,
        apply: F,
    ) -> Result<UpdateReport<E::Model>>
    where
        F: FnMut(&mut E::ActiveModel) -> Result<(), ApplyError> + Send,
    {
        let row = Row::new::<E>(id.into_value_tuple())?;
        self.update_row(row, apply).await
    }

    /// [`locked_update`](Self::locked_update) of a row while serializing on another key: the
    /// Django report's pattern, where all work on the Spams of one Ham is serialized by the Ham's
    /// key (`freshlock::lock_name::<ham::Entity>(spam.ham_id)`) without locking the Ham row. Every
    /// writer of the same row must use the same key. Everything else — reload, guard, fencing,
    /// cancellation — is as in `locked_update`; the report's lock name is `lock`.
    ///
    /// # Errors
    /// As [`locked_update`](Self::locked_update).
    ///
    /// # Cancel safety
    /// As [`locked_update`](Self::locked_update).
    pub async fn locked_update_under<F>(
        &self,
        lock: LockName,
        id: PrimaryKeyOf<E>,
        apply: F,
    ) -> Result<UpdateReport<E::Model>>
    where
        F: FnMut(&mut E::ActiveModel) -> Result<(), ApplyError> + Send,
    {
        let row = Row::new::<E>(id.into_value_tuple())?.locked_by(lock);
        self.update_row(row, apply).await
    }

    async fn update_row<F>(&self, row: Row, mut apply: F) -> Result<UpdateReport<E::Model>>
    where
        F: FnMut(&mut E::ActiveModel) -> Result<(), ApplyError> + Send,
    {
        if self.session.optimistic_first()
            && let Some(report) = self.optimistic(&row, &mut apply).await?
        {
            return Ok(report);
        }
        let target = row.to_string();
        let report = locked_update::run::<E, _>(&self.session, row, true, |found| match found {
            None => Ok(Decision::NotFound),
            Some(original) => {
                let mut draft = original.clone().into_active_model();
                apply(&mut draft).map_err(|source| Error::Apply {
                    target: target.clone(),
                    source: source.into_inner(),
                })?;
                Ok(update_or_keep::<E>(original, draft))
            }
        })
        .await?;
        Ok(report.map(update_outcome))
    }

    /// The one-statement optimistic write of [`crate::SessionBuilder::optimistic_first`]:
    /// `None` when the locked path must run (no version column, no cached row, nothing
    /// changed, or the row changed since it was cached).
    async fn optimistic<F>(
        &self,
        row: &Row,
        apply: &mut F,
    ) -> Result<Option<UpdateReport<E::Model>>>
    where
        F: FnMut(&mut E::ActiveModel) -> Result<(), ApplyError> + Send,
    {
        if self.session.version_column(TypeId::of::<E>()).is_none() {
            return Ok(None);
        }
        let Some(snapshot) = self.session.map().get::<E::Model>(&row.key) else {
            return Ok(None);
        };
        let mut draft = (*snapshot).clone().into_active_model();
        apply(&mut draft).map_err(|source| Error::Apply {
            target: row.to_string(),
            source: source.into_inner(),
        })?;
        if draft.get_primary_key_value().as_ref() != Some(row.pk()) {
            return Err(Error::PrimaryKeyChanged {
                target: row.to_string(),
            });
        }
        if !draft.is_changed() {
            return Ok(None);
        }
        // Against the snapshot `apply` ran on: a concurrent section may have evicted it since.
        // Its UPDATE is its own commit: a reply that does not come within the policy's bound
        // leaves it in doubt (see `deadline.rs`), and the cached row may be stale.
        let reply = self.session.policy().reply_deadline();
        let save = self.save_against(row.clone(), &snapshot, draft);
        let Ok(saved) = tokio::time::timeout(reply, save).await else {
            self.session.map().remove(&row.key);
            let no_reply = crate::deadline::no_reply(reply);
            return Err(commit::write_error("saving", row.name.as_str(), no_reply));
        };
        match saved? {
            SaveOutcome::Updated(model) => Ok(Some(UpdateReport {
                outcome: UpdateOutcome::Updated(model),
                lock: crate::outcome::LockReport {
                    backend: self.session.lock_backend().kind(),
                    name: row.lock.clone(),
                    held: false,
                    tries: 0,
                    waited: std::time::Duration::ZERO,
                    fence: None,
                    release_error: None,
                },
                attempts: 1,
                conflicts: 0,
                batch: 1,
            })),
            // Changed since it was cached (the save evicted it), gone, or holding what was
            // set: the locked path decides, on the row as it is now.
            _ => Ok(None),
        }
    }

    /// Deletes the row under its lock: takes the lock under the session's policy → begins →
    /// reloads the row (`FOR UPDATE`) → checks the lease's fence → runs `before_delete` →
    /// `DELETE` (also checking the version column when one is declared) → `after_delete` →
    /// commits → evicts the cached row → releases the lock.
    ///
    /// A [`locked_update`](Self::locked_update) racing the delete never brings the row back: it
    /// either ran before (and the delete removes its result) or reloads nothing and reports
    /// [`crate::UpdateOutcome::NotFound`].
    ///
    /// # Errors
    /// As [`locked_update`](Self::locked_update) (hooks' errors are [`Error::Database`]).
    ///
    /// # Cancel safety
    /// As [`locked_update`](Self::locked_update): past the decision to delete, the delete still
    /// commits when the caller is dropped.
    pub async fn locked_delete(&self, id: PrimaryKeyOf<E>) -> Result<DeleteReport<E::Model>> {
        let row = Row::new::<E>(id.into_value_tuple())?;
        let report = locked_update::run::<E, _>(&self.session, row, false, |found| {
            Ok(match found {
                None => Decision::NotFound,
                Some(original) => Decision::Delete(original),
            })
        })
        .await?;
        Ok(report.map(|written| match written {
            Written::Deleted(model) => DeleteOutcome::Deleted(model),
            Written::LeaseLost => DeleteOutcome::LeaseLost,
            // A delete decides nothing else; `NotFound` is the only other outcome.
            _ => DeleteOutcome::NotFound,
        }))
    }

    /// The row with primary key `id`, created from `init` when there is none; the `bool` says
    /// whether this call created it.
    ///
    /// A cached row is returned as it is (like [`load`](Self::load)); otherwise one `SELECT`
    /// finds an existing row without taking any lock. Only a missing row takes the row's lock
    /// (as [`locked_update`](Self::locked_update) does), reloads it in a transaction and inserts
    /// `init()` with the `before_save` / `after_save` hooks (`insert = true`). Callers racing for
    /// the same missing key — tasks or processes — get the same row, and exactly one of them
    /// creates it: a unique-key violation from a concurrent creator (one that did not take the
    /// lock, or a lock that was not had) means the row exists, and the next attempt loads the
    /// winner's row, never an error.
    ///
    /// `init`'s primary key may be left `NotSet` (it is set to `id`); if it is set, it must equal
    /// `id`.
    ///
    /// # Errors
    /// - [`Error::InvalidKey`] when `init`'s primary key differs from `id`; nothing is written.
    /// - Otherwise as [`locked_update`](Self::locked_update).
    ///
    /// # Cancel safety
    /// As [`locked_update`](Self::locked_update).
    pub async fn get_or_insert<F>(
        &self,
        id: PrimaryKeyOf<E>,
        mut init: F,
    ) -> Result<(Arc<E::Model>, bool)>
    where
        F: FnMut() -> E::ActiveModel + Send,
    {
        let row = Row::new::<E>(id.into_value_tuple())?;
        if let Some(cached) = self.session.map().get::<E::Model>(&row.key) {
            return Ok((cached, false));
        }
        if let Some(found) = self.fetch(row.clone(), false).await? {
            return Ok((found, false));
        }
        let target = row.to_string();
        let pk = row.pk().clone();
        let report = locked_update::run::<E, _>(&self.session, row, false, |found| {
            Ok(match found {
                Some(existing) => Decision::Keep(existing),
                None => Decision::Insert(keyed::<E>(init(), &pk)?),
            })
        })
        .await?;
        match report.outcome {
            Written::Inserted(model) => Ok((model, true)),
            Written::Unchanged(model) => Ok((model, false)),
            // Neither a write that could be refused by a fence nor a missing row is decided here.
            _ => Err(Error::Interrupted { target }),
        }
    }

    /// Under the row's lock, applies `apply` to the row if it exists, or to `init()` if it does
    /// not, and writes the result: an update of the changed columns (guarded, as in
    /// [`locked_update`](Self::locked_update)) or an insert
    /// ([`crate::UpdateOutcome::Inserted`]). If another writer creates the row between the
    /// reload and the insert (one that did not take the lock), the insert fails on the key and
    /// the whole section runs again, now applying `apply` to the existing row.
    ///
    /// `init`'s primary key may be left `NotSet` (it is set to `id`); if it is set, it must equal
    /// `id`.
    ///
    /// # Errors
    /// - [`Error::InvalidKey`] when `init`'s primary key differs from `id`.
    /// - Otherwise as [`locked_update`](Self::locked_update).
    ///
    /// # Cancel safety
    /// As [`locked_update`](Self::locked_update).
    pub async fn update_or_insert<I, F>(
        &self,
        id: PrimaryKeyOf<E>,
        mut init: I,
        mut apply: F,
    ) -> Result<UpdateReport<E::Model>>
    where
        I: FnMut() -> E::ActiveModel + Send,
        F: FnMut(&mut E::ActiveModel) -> Result<(), ApplyError> + Send,
    {
        let row = Row::new::<E>(id.into_value_tuple())?;
        let target = row.to_string();
        let pk = row.pk().clone();
        let report = locked_update::run::<E, _>(&self.session, row, false, |found| {
            let aborted = |source: ApplyError| Error::Apply {
                target: target.clone(),
                source: source.into_inner(),
            };
            match found {
                Some(original) => {
                    let mut draft = original.clone().into_active_model();
                    apply(&mut draft).map_err(aborted)?;
                    Ok(update_or_keep::<E>(original, draft))
                }
                None => {
                    let mut draft = keyed::<E>(init(), &pk)?;
                    apply(&mut draft).map_err(aborted)?;
                    if draft.get_primary_key_value().as_ref() != Some(&pk) {
                        return Err(Error::PrimaryKeyChanged {
                            target: target.clone(),
                        });
                    }
                    Ok(Decision::Insert(draft))
                }
            }
        })
        .await?;
        Ok(report.map(update_outcome))
    }
}

/// What a save found.
pub(crate) enum Saved<M> {
    /// Written; the row as stored, and what `after_save` made of it.
    Stored {
        stored: M,
        reported: M,
    },
    /// Nothing to write, and the row still holds what was set.
    Holds(M),
    Conflict,
    NotFound,
}

/// The statements of one save, on `db` (a transaction on MySQL/MariaDB, or a section's).
/// `autocommit`: the UPDATE is its own commit, so a lost connection leaves it in doubt.
pub(crate) async fn save_on<E, C>(
    db: &C,
    row: &Row,
    snapshot: &E::Model,
    model: E::ActiveModel,
    version: Option<E::Column>,
    autocommit: bool,
) -> Result<Saved<E::Model>>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
    C: ConnectionTrait,
{
    let fail = |operation| move |e| database(operation, row, e);
    let version_read = version.map(|column| match model.get(column) {
        ActiveValue::Unchanged(value) => value,
        _ => snapshot.get(column),
    });
    // Nothing the caller set differs from the snapshot: no hook runs (a `before_save` that
    // stamps `updated_at` would make a change that is not one), and nothing is written — the
    // row is only checked to still hold the snapshot (`Unchanged`), as `locked_update` does.
    let caller_changed = write::set_columns::<E>(&model)
        .iter()
        .any(|(column, value)| *value != snapshot.get(*column));
    let model = if caller_changed {
        write::before_save::<E, _>(model, db, false)
            .await
            .map_err(fail("running before_save for"))?
    } else {
        model
    };
    reject_set_primary_key::<E>(&model)?;
    let set = write::set_columns::<E>(&model);
    let mut changes: Vec<_> = set
        .iter()
        .filter(|(column, value)| *value != snapshot.get(*column))
        .cloned()
        .collect();
    let expected: Vec<_> = match (version, version_read) {
        (Some(column), Some(read)) => {
            let Some(next) = write::next_version(&read) else {
                return Err(Error::VersionColumn {
                    entity: E::default().table_name(),
                    column: column.as_str(),
                });
            };
            if !changes.is_empty() {
                changes.retain(|(changed, _)| changed.as_str() != column.as_str());
                changes.push((column, next));
            }
            vec![(column, read)]
        }
        _ => set
            .iter()
            .map(|(column, _)| (*column, snapshot.get(*column)))
            .collect(),
    };
    let stored = if changes.is_empty() {
        write::select_holding::<E, _>(db, row.pk(), &expected)
            .await
            .map_err(fail("checking"))?
    } else {
        write::update_returning::<E, _>(db, snapshot, &changes, &expected)
            .await
            // In autocommit the UPDATE is its own commit: a lost connection leaves it in doubt.
            .map_err(|e| {
                if autocommit {
                    commit::write_error("saving", row.name.as_str(), e)
                } else {
                    database("saving", row, e)
                }
            })?
    };
    match stored {
        Some(stored) if changes.is_empty() => Ok(Saved::Holds(stored)),
        Some(stored) => {
            let reported = write::after_save::<E, _>(stored.clone(), db, false)
                .await
                .map_err(fail("running after_save for"))?;
            Ok(Saved::Stored { stored, reported })
        }
        // Refused: tell a changed row from a missing one (only on this path).
        None => match select_by_key::<E>(row.pk())
            .one(db)
            .await
            .map_err(fail("checking"))?
        {
            Some(_) => Ok(Saved::Conflict),
            None => Ok(Saved::NotFound),
        },
    }
}

/// `before_save`, `INSERT … RETURNING`, `after_save` on `db`: the row, as stored, and what
/// `after_save` made of it.
pub(crate) async fn insert_on<E, C>(
    db: &C,
    model: E::ActiveModel,
) -> Result<(Row, E::Model, E::Model)>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
    C: ConnectionTrait,
{
    let entity = E::default();
    let fail = |e| database("inserting into", &entity.table_name(), e);
    let model = write::before_save::<E, _>(model, db, true)
        .await
        .map_err(fail)?;
    let stored = E::insert(model)
        .exec_with_returning(db)
        .await
        .map_err(fail)?;
    let row = Row::new::<E>(stored.get_primary_key_value())?;
    let reported = write::after_save::<E, _>(stored.clone(), db, true)
        .await
        .map_err(fail)?;
    Ok((row, stored, reported))
}

/// The row a save of `model` writes: its key must be set, and not `Set`.
pub(crate) fn saved_row<E: EntityTrait>(model: &E::ActiveModel) -> Result<Row> {
    let Some(pk) = model.get_primary_key_value() else {
        return Err(Error::InvalidKey {
            entity: E::default().table_name(),
            reason: "the primary key of the active model is not set".into(),
        });
    };
    reject_set_primary_key::<E>(model)?;
    Row::new::<E>(pk)
}

/// Whether `model`'s `Unchanged` columns agree with `snapshot` (it was built from that copy).
pub(crate) fn built_from<E: EntityTrait>(model: &E::ActiveModel, snapshot: &E::Model) -> bool {
    E::Column::iter().all(|column| match model.get(column) {
        ActiveValue::Unchanged(value) => value == snapshot.get(column),
        _ => true,
    })
}

/// [`InvalidKey`](Error::InvalidKey) when `model` has a primary-key column `Set`.
pub(crate) fn reject_set_primary_key<E>(model: &E::ActiveModel) -> Result<()>
where
    E: EntityTrait,
{
    match E::PrimaryKey::iter()
        .map(PrimaryKeyToColumn::into_column)
        .find(|column| matches!(model.get(*column), ActiveValue::Set(_)))
    {
        Some(column) => Err(Error::InvalidKey {
            entity: E::default().table_name(),
            reason: format!(
                "primary-key column {} is Set: a save identifies its row by the key and cannot \
                 change it (keep it Unchanged, as into_active_model does)",
                column.as_str()
            ),
        }),
        None => Ok(()),
    }
}

/// `draft` with its primary key set to `pk` where it was left `NotSet`;
/// [`InvalidKey`](Error::InvalidKey) when it holds another key.
pub(crate) fn keyed<E: EntityTrait>(
    mut draft: E::ActiveModel,
    pk: &ValueTuple,
) -> Result<E::ActiveModel> {
    for (key, value) in E::PrimaryKey::iter().zip(pk.iter()) {
        let column = key.into_column();
        match draft.get(column).into_value() {
            None => draft.set(column, value.clone()),
            Some(given) if given == *value => {}
            Some(given) => {
                return Err(Error::InvalidKey {
                    entity: E::default().table_name(),
                    reason: format!(
                        "the initial row's {} is {given}, but the row asked for is {value}",
                        column.as_str()
                    ),
                });
            }
        }
    }
    Ok(draft)
}

/// An update of what `apply` changed, or nothing to write.
fn update_or_keep<E: EntityTrait>(original: E::Model, draft: E::ActiveModel) -> Decision<E>
where
    E::ActiveModel: ActiveModelTrait<Entity = E>,
{
    if write::has_changes::<E>(&original, &draft) {
        Decision::Update { original, draft }
    } else {
        Decision::Keep(original)
    }
}

fn update_outcome<M>(written: Written<M>) -> UpdateOutcome<M> {
    match written {
        Written::Updated(model) => UpdateOutcome::Updated(model),
        Written::Unchanged(model) => UpdateOutcome::Unchanged(model),
        Written::Inserted(model) => UpdateOutcome::Inserted(model),
        Written::LeaseLost => UpdateOutcome::LeaseLost,
        // An update decides no delete; `NotFound` is the only other outcome.
        Written::Deleted(_) | Written::NotFound => UpdateOutcome::NotFound,
    }
}

/// `pk IN (…)` for single-column keys, `(a = … AND b = …) OR …` for composite ones.
fn any_of_keys<E: EntityTrait>(keys: impl Iterator<Item = ValueTuple>) -> Condition {
    let columns: Vec<E::Column> = E::PrimaryKey::iter().map(|pk| pk.into_column()).collect();
    match columns.as_slice() {
        [column] => Condition::all().add(column.is_in(keys.flat_map(ValueTuple::into_iter))),
        _ => keys.fold(Condition::any(), |any, key| {
            any.add(
                columns
                    .iter()
                    .zip(key.iter())
                    .fold(Condition::all(), |all, (column, value)| {
                        all.add(column.eq(value.clone()))
                    }),
            )
        }),
    }
}
