//! Cached reads and dirty-only writes of one entity type.

use std::{any::TypeId, collections::HashMap, marker::PhantomData, sync::Arc};

use sea_orm::{
    ActiveModelTrait, ColumnTrait, Condition, EntityTrait, IntoActiveModel, Iterable, ModelTrait,
    PrimaryKeyToColumn, QueryFilter,
    sea_query::{IntoValueTuple, ValueTuple},
};

use crate::{
    db::autocommit::autocommit,
    db::live::on_live_connection,
    error::{ApplyError, Error, Result, database},
    identity_map::{Key, PkKey},
    lock::LockName,
    outcome::{DeleteOutcome, DeleteReport, GetOutcome, UpdateOutcome, UpdateReport},
    session::Session,
    write::decision::{Decision, Written},
    write::locked_update,
    write::row::{Row, cache_key, select_by_key},
    write::row_sql::{self as write, keyed},
};

pub use crate::write::row::PrimaryKeyOf;

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
            self.session.pool()
        } else {
            self.session.reader_pool()
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
            let pool = self.session.reader_pool();
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

    /// The row with primary key `id`, created from `init` when there is none:
    /// [`GetOutcome::Found`] or [`GetOutcome::Created`] (this call created it).
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
    ) -> Result<GetOutcome<E::Model>>
    where
        F: FnMut() -> E::ActiveModel + Send,
    {
        let row = Row::new::<E>(id.into_value_tuple())?;
        if let Some(cached) = self.session.map().get::<E::Model>(&row.key) {
            return Ok(GetOutcome::Found(cached));
        }
        if let Some(found) = self.fetch(row.clone(), false).await? {
            return Ok(GetOutcome::Found(found));
        }
        let target = row.to_string();
        let named = row.clone();
        let report = locked_update::run::<E, _>(&self.session, row, false, |found| {
            Ok(match found {
                Some(existing) => Decision::Keep(existing),
                None => Decision::Insert(keyed::<E>(init(), named.pk())?),
            })
        })
        .await?;
        match report.outcome {
            Written::Inserted(model) => Ok(GetOutcome::Created(model)),
            Written::Unchanged(model) => Ok(GetOutcome::Found(model)),
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
        let named = row.clone();
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
                    let mut draft = keyed::<E>(init(), named.pk())?;
                    apply(&mut draft).map_err(aborted)?;
                    named.check_key::<E>(&draft)?;
                    Ok(Decision::Insert(draft))
                }
            }
        })
        .await?;
        Ok(report.map(update_outcome))
    }
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
