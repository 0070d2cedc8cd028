//! Several rows' locked write as a step of the engine (`engine.rs`): `locked_update_many` and
//! `locked_update_pair`. The same row write as `locked_update`'s (`row_write.rs`): reload under
//! the locks, hand the drafts to `apply`, then per changed row `before_save`, the key check, the
//! guarded UPDATE and `after_save` — the fence checked before the first UPDATE, so a lost lease
//! sends none, and the commit's evidence taken by the last UPDATE's own statement where the
//! database allows (otherwise by the engine at the commit).
//!
//! The rows are reloaded and written in one canonical order (their locks', then their names'),
//! the order the section took their locks in, so two writers of the same rows never wait on
//! each other's row locks in opposite orders. `apply` sees the drafts in the caller's order.

use crate::write::entity::Writable;
use std::{future::Future, marker::PhantomData, sync::Arc, time::Duration};

use sea_orm::{DatabaseTransaction, EntityTrait, IntoActiveModel};

use crate::{
    commit::Evidence,
    db::deadline::{Bounded, within},
    error::{ApplyError, Error, database},
    identity_map::Change,
    outcome::UpdateOutcome,
    session::Session,
    write::engine::{self, End, Fence, Step, Tried, Worked},
    write::locking::Locking,
    write::row::{Row, reload_for_update},
    write::row_sql::{self as write, Sending},
    write::row_write::{self, Updated},
};

/// What a rows' write does with its drafts once every row was reloaded: the caller's `apply`,
/// given the drafts in the caller's order and the attempt's transaction (which
/// `locked_update_with`'s `apply` writes in; a plain `apply` only hands it back).
pub(crate) trait Apply<E: EntityTrait>: Send {
    /// Whether `apply` may write in the transaction itself: then an attempt that changed none of
    /// its rows still commits as a section does, every lease checked at the commit and the
    /// commit's evidence taken.
    const WRITES: bool = false;

    /// Runs `apply` on `drafts`: the transaction back, with the cache effects of what `apply`
    /// wrote in it, or the error (and whether a guarded write of it conflicted).
    fn apply(
        &mut self,
        txn: DatabaseTransaction,
        label: &str,
        drafts: &mut [E::ActiveModel],
    ) -> impl Future<Output = (DatabaseTransaction, Applied)> + Send;
}

/// What [`Apply::apply`] did: the cache effects of its own statements, or the error and whether
/// a guarded write conflicted.
pub(crate) type Applied = Result<Vec<Change>, (Error, bool)>;

/// A plain `apply` over the drafts (`locked_update_many`, `_pair`).
pub(crate) struct Drafts<F>(pub(crate) F);

impl<E, F> Apply<E> for Drafts<F>
where
    E: EntityTrait,
    E::ActiveModel: Send,
    F: FnMut(&mut [E::ActiveModel]) -> Result<(), ApplyError> + Send,
{
    async fn apply(
        &mut self,
        txn: DatabaseTransaction,
        label: &str,
        drafts: &mut [E::ActiveModel],
    ) -> (DatabaseTransaction, Applied) {
        let applied = (self.0)(drafts).map(|()| Vec::new()).map_err(|source| {
            let error = Error::Apply {
                target: label.to_owned(),
                source: source.into_inner(),
            };
            (error, false)
        });
        (txn, applied)
    }
}

/// The write of `locked_update_many`, `_pair` and `_with`: its rows, in the caller's order, and
/// what it does with their drafts.
pub(crate) struct RowsStep<E, A> {
    pub(crate) entity: PhantomData<fn() -> E>,
    pub(crate) session: Session,
    pub(crate) rows: Vec<Row>,
    /// Indexes into `rows` in the canonical order (see the module docs).
    pub(crate) order: Vec<usize>,
    /// The rows' names joined: the write's name in logs and errors.
    pub(crate) label: String,
    pub(crate) apply: A,
}

/// What an attempt of the rows' write gives the engine.
type Attempted<M> = (DatabaseTransaction, Worked<Vec<UpdateOutcome<M>>>);

impl<E, A> RowsStep<E, A> {
    /// The bound on each round trip of this write (see `deadline.rs`).
    fn reply(&self) -> Duration {
        self.session.policy().reply_deadline()
    }

    /// The cache change that records `model` as `row`'s committed state.
    fn cached<M: Send + Sync + 'static>(row: &Row, model: &Arc<M>) -> Change {
        Change::cache(row.key.clone(), Arc::clone(model))
    }
}

impl<E, A> RowsStep<E, A>
where
    E: Writable,
    A: Apply<E>,
{
    /// Reloads every row under its lock, in the canonical order: the rows as found, by index.
    async fn reload(&mut self, txn: &DatabaseTransaction) -> Result<Vec<Option<E::Model>>, Error> {
        let reply = self.reply();
        let mut found = vec![None; self.rows.len()];
        for &i in &self.order {
            let row = &self.rows[i];
            let reload = reload_for_update::<E>(txn, row.pk(), None);
            found[i] = within(reply, reload)
                .await
                .map_err(|e| database("reloading", row, e))?;
        }
        Ok(found)
    }

    /// The rows' writes, once every row was found and `apply` made its drafts.
    async fn write(
        &mut self,
        txn: DatabaseTransaction,
        lockings: &mut [Locking],
        originals: Vec<E::Model>,
        mut drafts: Vec<Option<E::ActiveModel>>,
        applied: Vec<Change>,
    ) -> Attempted<E::Model> {
        // A draft whose key moved has changes: `row_write::changes` refuses it below.
        let originals: Vec<Arc<E::Model>> = originals.into_iter().map(Arc::new).collect();
        let mut outcomes: Vec<_> = (originals.iter())
            .map(|original| UpdateOutcome::Unchanged(Arc::clone(original)))
            .collect();
        // What `apply` wrote first, then the rows: a row's own state wins.
        let first = applied.len();
        let mut effects = applied;
        effects.extend(
            (self.rows.iter().zip(&originals)).map(|(row, original)| Self::cached(row, original)),
        );
        // The rows whose drafts differ from what was read (as `locked_update` decides: nothing
        // set to a new value runs no hook and writes nothing), in the canonical order; the last
        // one's UPDATE takes the commit's evidence.
        let writing: Vec<usize> = (self.order.iter().copied())
            .filter(|&i| {
                (drafts[i].as_ref()).is_some_and(|d| write::has_changes::<E>(&originals[i], d))
            })
            .collect();
        if writing.is_empty() && A::WRITES {
            // `apply` may have written: commit as a section does.
            let worked = Worked::Write {
                value: outcomes,
                evidence: None,
                fence: Fence::Releasing,
                effects,
            };
            return (txn, worked);
        }
        if writing.is_empty() {
            let worked = Worked::Kept {
                value: outcomes,
                end: End::Commit,
                effects,
            };
            return (txn, worked);
        }
        // Checked before the first UPDATE, so a lost lease sends none; a `table` lease is
        // released in this transaction, and the commit ends it.
        match engine::fences(&txn, lockings, &self.label).await {
            Ok(true) => {}
            Ok(false) => {
                let lost = self.rows.iter().map(|_| UpdateOutcome::LeaseLost).collect();
                return (txn, Worked::Undone(Tried::Done(lost)));
            }
            Err(error) => return (txn, Worked::Undone(Tried::failed(error))),
        }
        let version = self.session.version_of::<E>();
        let reply = self.reply();
        let mut evidence: Option<Evidence> = None;
        for (n, &i) in writing.iter().enumerate() {
            let (row, original) = (&self.rows[i], &originals[i]);
            let Some(draft) = drafts[i].take() else {
                continue;
            };
            let bounded = Bounded::new(&txn, reply);
            let changes = match row_write::changes::<E, _>(&bounded, row, original, draft).await {
                Ok(changes) if changes.is_empty() => continue,
                Ok(changes) => changes,
                Err(error) => return (txn, Worked::Undone(Tried::failed(error))),
            };
            let sending = Sending {
                db: self.session.pool(),
                markers: self.session.commit_markers() && n + 1 == writing.len(),
                reply,
                lease: None,
            };
            let updated = row_write::update::<E>(&txn, row, version, original, changes, sending);
            let (stored, taken) = match updated.await {
                Ok(Updated::Stored(stored, taken)) => (stored, taken),
                Ok(Updated::Refused) => {
                    return (txn, Worked::Undone(Tried::conflict(row.to_string())));
                }
                // No lease rides in these UPDATEs (`lease: None`); were it so, run again.
                Ok(Updated::LeaseNotConfirmed) => return (txn, Worked::Undone(Tried::Uncounted)),
                Err(error) => return (txn, Worked::Undone(Tried::failed(error))),
            };
            evidence = taken.or(evidence);
            let bounded = Bounded::new(&txn, reply);
            let reported = match write::after_save::<E, _>(stored.clone(), &bounded, false).await {
                Ok(reported) => reported,
                Err(e) => {
                    let error = database("running after_save for", row, e);
                    return (txn, Worked::Undone(Tried::failed(error)));
                }
            };
            effects[first + i] = Self::cached(row, &Arc::new(stored));
            outcomes[i] = UpdateOutcome::Updated(Arc::new(reported));
        }
        let worked = Worked::Write {
            value: outcomes,
            evidence,
            fence: Fence::Checked,
            effects,
        };
        (txn, worked)
    }
}

impl<E, A> Step for RowsStep<E, A>
where
    E: Writable,
    A: Apply<E>,
{
    type Output = Vec<UpdateOutcome<E::Model>>;

    /// Evict, reload, `apply`, write what changed.
    async fn run(
        &mut self,
        txn: DatabaseTransaction,
        lockings: &mut [Locking],
    ) -> Attempted<E::Model> {
        for row in &self.rows {
            self.session.map().remove(&row.key);
        }
        let found = match self.reload(&txn).await {
            Ok(found) => found,
            Err(error) => return (txn, Worked::Undone(Tried::failed(error))),
        };
        if found.iter().any(Option::is_none) {
            // A row is missing: `apply` is not called and nothing is written.
            let effects = (self.rows.iter().zip(&found))
                .filter_map(|(row, model)| model.as_ref().map(|m| (row, Arc::new(m.clone()))))
                .map(|(row, model)| Self::cached(row, &model))
                .collect();
            let value = (found.into_iter())
                .map(|model| {
                    model.map_or(UpdateOutcome::NotFound, |m| {
                        UpdateOutcome::Unchanged(Arc::new(m))
                    })
                })
                .collect();
            let worked = Worked::Kept {
                value,
                end: End::Commit,
                effects,
            };
            return (txn, worked);
        }
        let originals: Vec<E::Model> = found.into_iter().flatten().collect();
        let mut drafts: Vec<E::ActiveModel> = (originals.iter())
            .map(|model| model.clone().into_active_model())
            .collect();
        let (txn, applied) = self.apply.apply(txn, &self.label, &mut drafts).await;
        let applied = match applied {
            Ok(effects) => effects,
            Err((error, conflict)) => {
                return (txn, Worked::Undone(Tried::Failed { error, conflict }));
            }
        };
        let drafts = drafts.into_iter().map(Some).collect();
        self.write(txn, lockings, originals, drafts, applied).await
    }

    fn lease_lost(&mut self) -> Self::Output {
        self.rows.iter().map(|_| UpdateOutcome::LeaseLost).collect()
    }
}
