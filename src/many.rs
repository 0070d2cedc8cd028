//! Locked writes built on a retrying section: several rows of one entity in one transaction
//! ([`Repository::locked_update_many`], [`Repository::locked_update_pair`]), and one row whose
//! `apply` runs statements of its own in the transaction ([`Repository::locked_update_with`]).
//!
//! Each polls its section in place and, if the caller's future is dropped, moves it to a task
//! of its own (`apply` is `'static`; see `detach.rs`), so a drop never cuts a statement in half
//! — the section runs to its commit or rollback and releases its locks, as if the caller had
//! waited.

use std::{collections::HashSet, sync::Arc};

use sea_orm::{ActiveModelTrait, EntityTrait, IntoActiveModel, sea_query::IntoValueTuple};
use tokio::sync::Mutex;

use crate::{
    db::detach::Detachable,
    error::{ApplyError, Error, Result},
    outcome::{ManyReport, Report, SaveOutcome, UpdateOutcome, UpdateReport},
    repository::{PrimaryKeyOf, Repository},
    session::Session,
    tx::{ForUpdate, Tx},
    tx_repository::TxRepository,
    write::row::Row,
    write::section::{SectionOutcome, SectionWork},
};

impl<E> Repository<E>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
    /// Read-modify-write of several rows in one transaction, never overwriting a concurrent
    /// writer's columns: [`locked_update`](Self::locked_update) for a set of rows.
    ///
    /// In order: takes every row's lock under the session's backend and policy, in one canonical
    /// order (sorted by name), so two callers locking the same rows in opposite orders never
    /// deadlock, across processes too → opens one transaction → reloads every row in that order
    /// (`FOR UPDATE` off SQLite) → runs `apply` on the drafts, given in the order of `ids` →
    /// writes only each row's changed columns, each guarded as in `locked_update` (with the
    /// `before_save` / `after_save` hooks) → checks every lease's fence → commits (with a
    /// commit marker) → caches the stored rows → releases every lock.
    ///
    /// A guard conflict or a transient error (deadlock, lock timeout, busy SQLite, a connection
    /// lost before the commit) runs the whole set again, up to the policy's `write_attempts`. If a
    /// row is missing, `apply` is not called and nothing is written: see
    /// [`ManyReport::outcomes`].
    ///
    /// # Errors
    /// - [`Error::InvalidKey`] when no id, or the same id twice, is given.
    /// - [`Error::Apply`] when `apply` returned an error (nothing was written).
    /// - [`Error::PrimaryKeyChanged`] when `apply` moved a row's key.
    /// - Otherwise as [`locked_update`](Self::locked_update).
    ///
    /// # Cancel safety
    /// freshlock's one rule for a locked write whose caller is dropped (see
    /// [`locked_update`](Self::locked_update)): the section is polled in place and, if this
    /// future is dropped, moves to a task of its own (`apply` is `'static`), so a statement is
    /// never cut in half — it runs to its commit or rollback and releases its locks, as if the
    /// caller had waited.
    pub async fn locked_update_many<I, F>(&self, ids: I, apply: F) -> Result<ManyReport<E::Model>>
    where
        I: IntoIterator<Item = PrimaryKeyOf<E>>,
        F: FnMut(&mut [E::ActiveModel]) -> Result<(), ApplyError> + Send + 'static,
    {
        let rows = rows::<E>(ids)?;
        let session = self.session().clone();
        Detachable::new(update_many::<E, F>(session, rows, apply)).await
    }

    /// [`locked_update_many`](Self::locked_update_many) of two rows (a transfer between two
    /// accounts, say): `apply` gets the drafts of `a` and `b`.
    ///
    /// # Errors
    /// As [`locked_update_many`](Self::locked_update_many) (`a == b` is
    /// [`Error::InvalidKey`]).
    ///
    /// # Cancel safety
    /// As [`locked_update_many`](Self::locked_update_many).
    pub async fn locked_update_pair<F>(
        &self,
        a: PrimaryKeyOf<E>,
        b: PrimaryKeyOf<E>,
        mut apply: F,
    ) -> Result<ManyReport<E::Model>>
    where
        F: FnMut(&mut E::ActiveModel, &mut E::ActiveModel) -> Result<(), ApplyError>
            + Send
            + 'static,
    {
        self.locked_update_many([a, b], move |drafts| match drafts {
            [a, b] => apply(a, b),
            _ => Err(ApplyError::msg(
                "a pair update was given another number of rows",
            )),
        })
        .await
    }

    /// [`locked_update`](Self::locked_update) whose `apply` is async and gets the section's
    /// [`Tx`]: it can read a related row or insert an audit row in the same transaction, through
    /// [`Tx::repository`] or plain sea-orm. Everything it writes commits or rolls back with the
    /// row's update, and reaches the cache only at the commit. The section is re-run (and
    /// `apply` with it) on a guard conflict or a transient error.
    ///
    /// ```
    /// # use entity::{ham, node};
    /// # use freshlock::Session;
    /// # use migration::Migrator;
    /// # use sea_orm::{EntityTrait, Set};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let db = freshlock::testing::TestDatabase::with_migrator::<Migrator>().await?;
    /// # let session = Session::new(db.connection().clone());
    /// # node::Entity::insert(node::ActiveModel::fresh(1)).exec(db.connection()).await?;
    /// let nodes = session.repository::<node::Entity>();
    /// nodes
    ///     .locked_update_with(1, |node, tx| {
    ///         Box::pin(async move {
    ///             let parent = tx.repository::<ham::Entity>().load(7).await?;
    ///             node.title = Set(parent.map_or_else(String::new, |h| h.name.clone()));
    ///             Ok(())
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`locked_update`](Self::locked_update); errors of `apply`'s own statements as
    /// [`Session::with_lock`] returns them.
    ///
    /// # Cancel safety
    /// As [`locked_update_many`](Self::locked_update_many).
    pub async fn locked_update_with<F>(
        &self,
        id: PrimaryKeyOf<E>,
        apply: F,
    ) -> Result<UpdateReport<E::Model>>
    where
        F: for<'a> FnMut(&'a mut E::ActiveModel, &'a Tx) -> SectionWork<'a, ()> + Send + 'static,
    {
        let row = Row::new::<E>(id.into_value_tuple())?;
        let session = self.session().clone();
        Detachable::new(update_with::<E, F>(session, row, apply)).await
    }
}

/// The rows of `ids`: at least one, none twice.
fn rows<E: EntityTrait>(ids: impl IntoIterator<Item = PrimaryKeyOf<E>>) -> Result<Vec<Row>> {
    let rows = ids
        .into_iter()
        .map(|id| Row::new::<E>(id.into_value_tuple()))
        .collect::<Result<Vec<_>>>()?;
    let entity = E::default().table_name();
    if rows.is_empty() {
        return Err(Error::InvalidKey {
            entity,
            reason: "no row was given".into(),
        });
    }
    let mut seen = HashSet::new();
    if let Some(twice) = rows.iter().find(|row| !seen.insert(row.key.clone())) {
        return Err(Error::InvalidKey {
            entity,
            reason: format!("{twice} was given twice"),
        });
    }
    Ok(rows)
}

fn rows_label(rows: &[Row]) -> String {
    rows.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("+")
}

async fn update_many<E, F>(
    session: Session,
    rows: Vec<Row>,
    apply: F,
) -> Result<ManyReport<E::Model>>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
    F: FnMut(&mut [E::ActiveModel]) -> Result<(), ApplyError> + Send + 'static,
{
    // The canonical order: the locks' (the section sorts them the same way), then the rows'.
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| (&rows[a].lock, &rows[a].name).cmp(&(&rows[b].lock, &rows[b].name)));
    for row in &rows {
        session.map().remove(&row.key);
    }
    let (rows, order) = (Arc::new(rows), Arc::new(order));
    let apply = Arc::new(Mutex::new(apply));
    let label = rows_label(&rows);
    let report = session
        .section(rows.iter().map(|row| row.lock.clone()))
        .run_retrying(|tx| {
            let (rows, order, apply) = (Arc::clone(&rows), Arc::clone(&order), Arc::clone(&apply));
            let label = label.clone();
            Box::pin(async move {
                let repo = tx.repository::<E>();
                let mut found = vec![None; rows.len()];
                for &i in order.iter() {
                    found[i] = repo.load_row_locked(&rows[i], ForUpdate::Wait).await?;
                }
                if found.iter().any(Option::is_none) {
                    return Ok(found
                        .into_iter()
                        .map(|model| {
                            model.map_or(UpdateOutcome::NotFound, UpdateOutcome::Unchanged)
                        })
                        .collect());
                }
                let originals: Vec<Arc<E::Model>> = found.into_iter().flatten().collect();
                let mut drafts: Vec<E::ActiveModel> = originals
                    .iter()
                    .map(|model| (**model).clone().into_active_model())
                    .collect();
                (apply.lock().await)(&mut drafts).map_err(|source| Error::Apply {
                    target: label.clone(),
                    source: source.into_inner(),
                })?;
                let mut drafts: Vec<Option<E::ActiveModel>> =
                    drafts.into_iter().map(Some).collect();
                let mut outcomes: Vec<Option<UpdateOutcome<E::Model>>> =
                    (0..rows.len()).map(|_| None).collect();
                for &i in order.iter() {
                    let Some(draft) = drafts[i].take() else {
                        continue;
                    };
                    outcomes[i] = Some(write_row(&repo, &rows[i], &originals[i], draft).await?);
                }
                Ok(outcomes.into_iter().flatten().collect())
            }) as SectionWork<'_, Vec<UpdateOutcome<E::Model>>>
        })
        .await?;
    let outcomes = match report.outcome {
        SectionOutcome::Committed(outcomes) => outcomes,
        _ => rows.iter().map(|_| UpdateOutcome::LeaseLost).collect(),
    };
    Ok(ManyReport {
        outcomes,
        locks: report.locks,
        attempts: report.attempts,
        conflicts: report.conflicts,
    })
}

/// Writes `draft`'s changes to `row` (read locked as `original`), guarded; a refusal is a
/// conflict error, which runs the section again.
async fn write_row<E>(
    repo: &TxRepository<'_, E>,
    row: &Row,
    original: &Arc<E::Model>,
    draft: E::ActiveModel,
) -> Result<UpdateOutcome<E::Model>>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
    row.check_key::<E>(&draft)?;
    if !draft.is_changed() {
        return Ok(UpdateOutcome::Unchanged(Arc::clone(original)));
    }
    match repo.save_row(row, original, draft).await? {
        SaveOutcome::Updated(model) => Ok(UpdateOutcome::Updated(model)),
        SaveOutcome::Unchanged => Ok(UpdateOutcome::Unchanged(Arc::clone(original))),
        // Locked since the reload: only a write outside every lock can get here.
        _ => Err(Error::Conflict {
            target: row.to_string(),
            attempts: 1,
        }),
    }
}

async fn update_with<E, F>(session: Session, row: Row, apply: F) -> Result<UpdateReport<E::Model>>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
    F: for<'a> FnMut(&'a mut E::ActiveModel, &'a Tx) -> SectionWork<'a, ()> + Send + 'static,
{
    session.map().remove(&row.key);
    let row = Arc::new(row);
    let apply = Arc::new(Mutex::new(apply));
    let report = session
        .section([row.lock.clone()])
        .run_retrying(|tx| {
            let (row, apply) = (Arc::clone(&row), Arc::clone(&apply));
            Box::pin(async move {
                let repo = tx.repository::<E>();
                let Some(original) = repo.load_row_locked(&row, ForUpdate::Wait).await? else {
                    return Ok(UpdateOutcome::NotFound);
                };
                let mut draft = (*original).clone().into_active_model();
                {
                    let mut apply = apply.lock().await;
                    (apply)(&mut draft, tx).await.map_err(|source| {
                        // The section's statements' errors stay what they are.
                        match crate::write::section::section_error(row.name.as_str(), source) {
                            Error::SectionAborted { source, .. } => Error::Apply {
                                target: row.to_string(),
                                source,
                            },
                            other => other,
                        }
                    })?;
                }
                Ok(write_row(&repo, &row, &original, draft).await?)
            }) as SectionWork<'_, UpdateOutcome<E::Model>>
        })
        .await?;
    Ok(Report {
        batch: 1,
        outcome: match report.outcome {
            SectionOutcome::Committed(outcome) => outcome,
            _ => UpdateOutcome::LeaseLost,
        },
        lock: report.lock,
        attempts: report.attempts,
        conflicts: report.conflicts,
    })
}
