//! Cached reads and dirty-only writes of one entity type.

use std::{any::TypeId, collections::HashMap, marker::PhantomData, sync::Arc};

use sea_orm::{
    ActiveModelTrait, ActiveValue, ColumnTrait, Condition, DbErr, EntityTrait, IntoActiveModel,
    Iterable, ModelTrait, PrimaryKeyToColumn, PrimaryKeyTrait, QueryFilter, Value,
    sea_query::{IntoValueTuple, ValueTuple},
};

use crate::{
    LockName,
    error::{ApplyError, Error, Result, database},
    identity_map::{Key, PkKey},
    locked_update,
    outcome::{SaveOutcome, UpdateReport},
    row::{Row, cache_key, select_by_key},
    session::Session,
};

/// The primary-key value type of entity `E` (`i32` for a single integer key, a tuple for a
/// composite key).
pub type PrimaryKeyOf<E> = <<E as EntityTrait>::PrimaryKey as PrimaryKeyTrait>::ValueType;

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
    /// from the database and cached. A second load of the same id sends no SQL.
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
        self.fetch(Row::new::<E>(key.1.to_tuple())?).await
    }

    /// The row with primary key `id`, always read from the database (the cache is refreshed with
    /// what was read, or forgets the row when it is gone).
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub async fn load_fresh(&self, id: PrimaryKeyOf<E>) -> Result<Option<Arc<E::Model>>> {
        let row = Row::new::<E>(id.into_value_tuple())?;
        self.fetch(row).await
    }

    async fn fetch(&self, row: Row) -> Result<Option<Arc<E::Model>>> {
        let found = select_by_key::<E>(row.pk())
            .one(self.session.connection())
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
            let models = E::find()
                .filter(any_of_keys::<E>(
                    chunk.iter().map(|(_, key)| key.1.to_tuple()),
                ))
                .all(self.session.connection())
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

    /// Inserts a row and caches it as the database returned it.
    ///
    /// # Errors
    /// [`Error::Database`] when the insert fails.
    pub async fn insert(&self, model: E::ActiveModel) -> Result<Arc<E::Model>>
    where
        E::ActiveModel: ActiveModelTrait<Entity = E>,
    {
        let entity = E::default();
        let inserted = E::insert(model)
            .exec_with_returning(self.session.connection())
            .await
            .map_err(|e| database("inserting into", &entity.table_name(), e))?;
        let row = Row::new::<E>(inserted.get_primary_key_value())?;
        let inserted = Arc::new(inserted);
        self.session.map().insert(row.key, Arc::clone(&inserted));
        Ok(inserted)
    }

    /// Writes the changed columns of an existing row, without a lock.
    ///
    /// Only columns that are `Set` are written, and when the row is cached, a column `Set` to the
    /// value it has in the cache is not a change: when nothing changed, no SQL is sent at all.
    /// After the write the cache holds the row as committed.
    ///
    /// This is a plain write: it does not reread the row, so it is only as fresh as the values
    /// you set. For read-modify-write use [`locked_update`](Self::locked_update).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when the primary key is not set; [`Error::Database`] when the update
    /// fails.
    pub async fn save(&self, mut model: E::ActiveModel) -> Result<SaveOutcome<E::Model>>
    where
        E::ActiveModel: ActiveModelTrait<Entity = E>,
    {
        let pk = model
            .get_primary_key_value()
            .ok_or_else(|| Error::InvalidKey {
                entity: E::default().table_name(),
                reason: "the primary key of the active model is not set".into(),
            })?;
        let row = Row::new::<E>(pk)?;
        let db = self.session.connection();
        let result = match self.session.map().get::<E::Model>(&row.key) {
            Some(cached) => {
                let changes = changed_columns::<E>(&cached, &mut model);
                if changes.is_empty() {
                    return Ok(SaveOutcome::Unchanged);
                }
                match write_changes::<E, _>(db, &cached, &changes, Guard::Unguarded).await {
                    Ok(true) => with_changes::<E>(&cached, changes),
                    Ok(false) => Err(DbErr::RecordNotUpdated),
                    Err(e) => Err(e),
                }
            }
            None => {
                if !model.is_changed() {
                    return Ok(SaveOutcome::Unchanged);
                }
                // Nothing to compare with: write what is `Set`, and take the row the database
                // returns (RETURNING, or a SELECT on MySQL) as the committed one.
                E::update(model).exec(db).await
            }
        };
        match result {
            Ok(committed) => {
                let committed = Arc::new(committed);
                self.session.map().insert(row.key, Arc::clone(&committed));
                Ok(SaveOutcome::Updated(committed))
            }
            Err(DbErr::RecordNotUpdated) => {
                self.session.map().remove(&row.key);
                Ok(SaveOutcome::NotFound)
            }
            Err(e) => Err(database("saving", &row, e)),
        }
    }

    /// Read-modify-write of one row that never overwrites a concurrent writer's columns.
    ///
    /// In order: takes the lock for this row under the session's [`crate::LockPolicy`] → evicts
    /// the cached row → opens a transaction (`BEGIN IMMEDIATE` on SQLite, `READ COMMITTED` on
    /// PostgreSQL and MySQL) → reloads the row through it (`FOR UPDATE` on PostgreSQL and MySQL) →
    /// runs `apply` on it → writes only the columns `apply` changed (nothing when it changed
    /// none) → commits → caches the committed row → releases the lock.
    ///
    /// `apply` is a synchronous closure that sets columns on the freshly read row; it may return
    /// an error (any error converts with `?`) to abort without writing. It is `FnMut` because it
    /// may be run again on a retry, so keep it free of side effects other than setting columns.
    /// Do the heavy work *before* calling this; the lock is held only for the reload and write.
    ///
    /// A missing row is the outcome [`crate::UpdateOutcome::NotFound`], not an error.
    ///
    /// # Errors
    /// - [`Error::Apply`] when `apply` returned an error; nothing was written.
    /// - [`Error::PrimaryKeyChanged`] when `apply` changed a primary-key column.
    /// - [`Error::LockNotAcquired`] / [`Error::Lock`] when the lock could not be had and the
    ///   policy says to fail.
    /// - [`Error::Database`] when a statement failed; the transaction was rolled back.
    ///
    /// In every error case, and when `apply` panics (the panic is resumed in the caller after the
    /// rollback), the transaction is rolled back, the cache holds no half-applied row and the lock
    /// is released.
    ///
    /// # Cancel safety
    /// The locked section is polled in place, and moved to a task of its own when this future is
    /// dropped, so a drop never interrupts a statement halfway (which would make the driver close
    /// the connection — with in-memory SQLite, destroying the database). If the future is dropped before `apply` has returned, the
    /// section rolls back; if it is dropped after, the write still commits and the cache is
    /// updated. Either way the lock is released after the transaction has ended.
    pub async fn locked_update<F>(
        &self,
        id: PrimaryKeyOf<E>,
        apply: F,
    ) -> Result<UpdateReport<E::Model>>
    where
        F: FnMut(&mut E::ActiveModel) -> Result<(), ApplyError> + Send,
    {
        let row = Row::new::<E>(id.into_value_tuple())?;
        locked_update::run::<E, F>(&self.session, row, apply).await
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
        locked_update::run::<E, F>(&self.session, row, apply).await
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

/// The columns `Set` in `draft` to a value other than `original`'s, taken out of `draft`.
pub(crate) fn changed_columns<E: EntityTrait>(
    original: &E::Model,
    draft: &mut E::ActiveModel,
) -> Vec<(E::Column, Value)>
where
    E::ActiveModel: ActiveModelTrait<Entity = E>,
{
    E::Column::iter()
        .filter_map(|column| match draft.take(column) {
            ActiveValue::Set(value) if value != original.get(column) => Some((column, value)),
            _ => None,
        })
        .collect()
}

/// What the UPDATE of a write checks besides the primary key.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Guard {
    /// Nothing: a plain write (`save`).
    Unguarded,
    /// Each changed column still holds the value read (NULL compared as NULL).
    Columns,
    /// The version column still holds the value read (the caller adds its increment to the
    /// changes).
    Version(&'static str),
}

/// `UPDATE … SET <changes> WHERE pk = <original's pk> [AND <guard>]`, one statement. Returns
/// whether a row was written: `false` when none matched (the row is gone, or the guard refused).
pub(crate) async fn write_changes<E, C>(
    db: &C,
    original: &E::Model,
    changes: &[(E::Column, Value)],
    guard: Guard,
) -> std::result::Result<bool, DbErr>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
    C: sea_orm::ConnectionTrait,
{
    let mut update = original.clone().into_active_model();
    for (column, value) in changes {
        update.set(*column, value.clone());
    }
    let mut update = E::update(update).validate()?;
    let expect = |update: sea_orm::ValidatedUpdateOne<E::ActiveModel>, column: E::Column| {
        let read = original.get(column);
        if read == read.as_null() {
            update.filter(column.is_null())
        } else {
            update.filter(column.eq(read))
        }
    };
    match guard {
        Guard::Unguarded => {}
        Guard::Columns => {
            for (column, _) in changes {
                update = expect(update, *column);
            }
        }
        Guard::Version(name) => {
            if let Some(column) = column_named::<E>(name) {
                update = expect(update, column);
            }
        }
    }
    match update.exec_without_returning(db).await {
        Ok(_) => Ok(true),
        Err(DbErr::RecordNotUpdated) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `E`'s column called `name`.
pub(crate) fn column_named<E: EntityTrait>(name: &str) -> Option<E::Column> {
    use sea_orm::IdenStatic;
    E::Column::iter().find(|column| column.as_str() == name)
}

/// The next value of an integer version column, as read in `original`.
pub(crate) fn next_version<E: EntityTrait>(
    original: &E::Model,
    name: &'static str,
) -> Option<(E::Column, Value)> {
    let column = column_named::<E>(name)?;
    let next = match original.get(column) {
        Value::TinyInt(Some(v)) => Value::TinyInt(Some(v.wrapping_add(1))),
        Value::SmallInt(Some(v)) => Value::SmallInt(Some(v.wrapping_add(1))),
        Value::Int(Some(v)) => Value::Int(Some(v.wrapping_add(1))),
        Value::BigInt(Some(v)) => Value::BigInt(Some(v.wrapping_add(1))),
        Value::TinyUnsigned(Some(v)) => Value::TinyUnsigned(Some(v.wrapping_add(1))),
        Value::SmallUnsigned(Some(v)) => Value::SmallUnsigned(Some(v.wrapping_add(1))),
        Value::Unsigned(Some(v)) => Value::Unsigned(Some(v.wrapping_add(1))),
        Value::BigUnsigned(Some(v)) => Value::BigUnsigned(Some(v.wrapping_add(1))),
        _ => return None,
    };
    Some((column, next))
}

/// `original` with `changes` applied: the row as the UPDATE left it.
pub(crate) fn with_changes<E: EntityTrait>(
    original: &E::Model,
    changes: Vec<(E::Column, Value)>,
) -> std::result::Result<E::Model, DbErr> {
    let mut model = original.clone();
    for (column, value) in changes {
        model.try_set(column, value)?;
    }
    Ok(model)
}
