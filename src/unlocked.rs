//! The repository's writes without a lock: `insert`, the optimistic `save` (one guarded
//! statement against the session's snapshot) and `optimistic_first`'s one-statement
//! `locked_update`. Their statements are `save.rs`'s, shared with a section's `TxRepository`.

use std::{any::TypeId, sync::Arc};

use sea_orm::{ActiveModelTrait, DbBackend, EntityTrait, IntoActiveModel};

use crate::{
    commit,
    db::autocommit::autocommit,
    db::{
        begin,
        deadline::Bounded,
        own::{Own, rollback_after},
    },
    error::{ApplyError, Error, Result, database},
    outcome::{SaveOutcome, UpdateOutcome, UpdateReport},
    repository::Repository,
    write::row::Row,
    write::row_sql::{built_from, saved_row},
    write::save::{Saved, insert_on, save_on},
};

impl<E> Repository<E>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: ActiveModelTrait<Entity = E> + Send,
{
    /// Inserts a row and caches it as the database stored it (`RETURNING`, or a read back on
    /// MySQL/MariaDB). Runs the entity's `before_save` / `after_save` hooks (`insert = true`), as
    /// sea-orm's `ActiveModel::insert` does; returns what `after_save` returned.
    ///
    /// # Errors
    /// [`Error::Database`] when the insert or a hook fails (a unique-key violation included:
    /// use [`get_or_insert`](Self::get_or_insert) when another writer may create the row).
    pub async fn insert(&self, model: E::ActiveModel) -> Result<Arc<E::Model>> {
        let (row, stored, reported) =
            insert_on::<E, _>(&autocommit(self.session().pool()), model).await?;
        self.session().map().insert(row.key, Arc::new(stored));
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
        let Some(snapshot) = self.session().map().get::<E::Model>(&row.key) else {
            return Err(Error::NoSnapshot {
                target: row.to_string(),
            });
        };
        if !built_from::<E>(&model, &snapshot) {
            self.session().map().remove(&row.key);
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
        let version = self.session().version_of::<E>();
        let db = self.session().pool();
        // Every round trip waits at most the policy's reply bound (see `deadline.rs`); the
        // `BEGIN` finishes in a task of its own if its caller goes (see `detach.rs`).
        let reply = self.session().policy().reply_deadline();
        let saved = if db.get_database_backend() == DbBackend::MySql || db.transaction_pooled() {
            // MySQL: no UPDATE … RETURNING, and the read back must see this UPDATE's row, not a
            // later one. Behind a transaction pooler: the UPDATE and a conflict's check read
            // must not run outside a transaction (see `transaction_pooler.rs`).
            let own = Own::new(db, reply).with(begin::options(db).await);
            let txn = (own.begin().await).map_err(|e| database("saving", &row, e))?;
            let bounded = Bounded::new(&txn, reply);
            let saved = save_on::<E, _>(&bounded, &row, snapshot, model, version, false).await;
            let silent = bounded.went_silent();
            match saved {
                Ok(saved) => {
                    (own.commit(txn).await)
                        .map_err(|e| commit::write_error("committing", row.name.as_str(), e))?;
                    Ok(saved)
                }
                Err(error) => {
                    rollback_after(txn, reply, silent).await;
                    Err(error)
                }
            }
        } else {
            let bounded = Bounded::new(db.connection(), reply);
            save_on::<E, _>(&bounded, &row, snapshot, model, version, true).await
        }?;
        Ok(match saved {
            Saved::Stored { stored, reported } => {
                self.session().map().insert(row.key, Arc::new(stored));
                SaveOutcome::Updated(Arc::new(reported))
            }
            Saved::Holds(stored) => {
                self.session().map().insert(row.key, Arc::new(stored));
                SaveOutcome::Unchanged
            }
            Saved::Conflict => {
                self.session().map().remove(&row.key);
                SaveOutcome::Conflict
            }
            Saved::NotFound => {
                self.session().map().remove(&row.key);
                SaveOutcome::NotFound
            }
        })
    }

    /// The one-statement optimistic write of [`crate::SessionBuilder::optimistic_first`]:
    /// `None` when the locked path must run (no version column, no cached row, nothing
    /// changed, or the row changed since it was cached).
    pub(crate) async fn optimistic<F>(
        &self,
        row: &Row,
        apply: &mut F,
    ) -> Result<Option<UpdateReport<E::Model>>>
    where
        F: FnMut(&mut E::ActiveModel) -> Result<(), ApplyError> + Send,
    {
        if self.session().version_column(TypeId::of::<E>()).is_none() {
            return Ok(None);
        }
        let Some(snapshot) = self.session().map().get::<E::Model>(&row.key) else {
            return Ok(None);
        };
        let mut draft = (*snapshot).clone().into_active_model();
        apply(&mut draft).map_err(|source| Error::Apply {
            target: row.to_string(),
            source: source.into_inner(),
        })?;
        row.check_key::<E>(&draft)?;
        if !draft.is_changed() {
            return Ok(None);
        }
        // Against the snapshot `apply` ran on: a concurrent section may have evicted it since.
        // Its UPDATE is its own commit: a reply that does not come within the policy's bound
        // leaves it in doubt (`Error::CommitUnknown`, see `save_against`), and the cached row
        // may be stale then.
        let saved = self.save_against(row.clone(), &snapshot, draft).await;
        if saved.is_err() {
            self.session().map().remove(&row.key);
        }
        match saved? {
            SaveOutcome::Updated(model) => Ok(Some(UpdateReport {
                outcome: UpdateOutcome::Updated(model),
                lock: crate::outcome::LockReport {
                    backend: self.session().lock_backend().kind(),
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
}
