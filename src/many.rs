//! Locked writes of several rows of one entity in one transaction
//! ([`Repository::locked_update_many`], [`Repository::locked_update_pair`]), and of one row whose
//! `apply` runs statements of its own in the transaction ([`Repository::locked_update_with`]).
//! They take their locks as a section does (one canonical order) and run the rows' write step
//! (`write/rows_step.rs`), whose row write is `locked_update`'s (`write/row_write.rs`): the
//! same hooks, key check, guard, fence before the first UPDATE and evidence in the last.
//!
//! Each polls its write in place and, if the caller's future is dropped, moves it to a task
//! of its own (`apply` is `'static`; see `detach.rs`), so a drop never cuts a statement in half
//! — the section runs to its commit or rollback and releases its locks, as if the caller had
//! waited.

use crate::write::entity::Writable;
use std::collections::HashSet;

use sea_orm::{DatabaseTransaction, EntityTrait, IntoActiveModel, sea_query::IntoValueTuple};

use crate::{
    db::detach::Detachable,
    error::{ApplyError, Error, Result},
    outcome::{ManyReport, Report, UpdateOutcome, UpdateReport},
    repository::{PrimaryKeyOf, Repository},
    session::Session,
    tx::Tx,
    write::row::Row,
    write::rows_step::{Applied, Apply, Drafts, RowsStep},
    write::section::SectionWork,
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
    /// checks every lease's fence (a lost lease sends no UPDATE) → writes only each row's
    /// changed columns, each guarded as in `locked_update` (with the `before_save` /
    /// `after_save` hooks), the last UPDATE taking the commit's evidence where the database
    /// allows → commits → caches the stored rows → releases every lock.
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
    E: Writable,
    F: FnMut(&mut [E::ActiveModel]) -> Result<(), ApplyError> + Send + 'static,
{
    // The canonical order: the locks' (the section sorts them the same way), then the rows'.
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| (&rows[a].lock, &rows[a].name).cmp(&(&rows[b].lock, &rows[b].name)));
    let locks: Vec<_> = rows.iter().map(|row| row.lock.clone()).collect();
    let mut step = RowsStep::<E, _> {
        entity: std::marker::PhantomData,
        session: session.clone(),
        label: rows_label(&rows),
        rows,
        order,
        apply: Drafts(apply),
    };
    let ran = session.section(locks).run_step(true, &mut step).await?;
    Ok(ManyReport {
        outcomes: ran.value,
        locks: ran.locks,
        attempts: ran.attempts,
        conflicts: ran.conflicts,
    })
}

async fn update_with<E, F>(session: Session, row: Row, apply: F) -> Result<UpdateReport<E::Model>>
where
    E: Writable,
    F: for<'a> FnMut(&'a mut E::ActiveModel, &'a Tx) -> SectionWork<'a, ()> + Send + 'static,
{
    let locks = [row.lock.clone()];
    let mut step = RowsStep::<E, _> {
        entity: std::marker::PhantomData,
        session: session.clone(),
        label: row.to_string(),
        apply: WithTx {
            session: session.clone(),
            name: row.name.as_str().to_owned(),
            apply,
        },
        rows: vec![row],
        order: vec![0],
    };
    let ran = session.section(locks).run_step(true, &mut step).await?;
    let lock = ran
        .locks
        .into_iter()
        .next()
        .ok_or_else(|| Error::Interrupted {
            target: step.label.clone(),
        })?;
    Ok(Report {
        batch: 1,
        outcome: ran
            .value
            .into_iter()
            .next()
            .unwrap_or(UpdateOutcome::NotFound),
        lock,
        attempts: ran.attempts,
        conflicts: ran.conflicts,
    })
}

/// `locked_update_with`'s `apply`: run on the draft with the attempt's transaction as a [`Tx`],
/// so that what it writes there commits with the row (and reaches the cache at the commit).
struct WithTx<F> {
    session: Session,
    /// The row's lock name, which names a failed `apply`'s own statements.
    name: String,
    apply: F,
}

impl<E, F> Apply<E> for WithTx<F>
where
    E: EntityTrait,
    E::ActiveModel: Send,
    F: for<'a> FnMut(&'a mut E::ActiveModel, &'a Tx) -> SectionWork<'a, ()> + Send,
{
    const WRITES: bool = true;

    async fn apply(
        &mut self,
        txn: DatabaseTransaction,
        label: &str,
        drafts: &mut [E::ActiveModel],
    ) -> (DatabaseTransaction, Applied) {
        let tx = Tx::new(txn, self.session.clone());
        let worked = match drafts {
            [draft] => (self.apply)(draft, &tx).await,
            _ => Err(ApplyError::msg(
                "locked_update_with was given another number of rows",
            )),
        };
        let (txn, effects, conflicted) = tx.into_parts();
        let txn = txn.into_sea();
        let applied = worked.map(|()| effects).map_err(|source| {
            // The section's statements' errors stay what they are.
            let error = match crate::write::section::section_error(&self.name, source) {
                Error::SectionAborted { source, .. } => Error::Apply {
                    target: label.to_owned(),
                    source,
                },
                other => other,
            };
            (error, conflicted)
        });
        (txn, applied)
    }
}
