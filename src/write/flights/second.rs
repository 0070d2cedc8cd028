//! Flight 2 of a write in two flights: the guarded UPDATE and its `COMMIT` in one message, or,
//! when the hooks wrote in the transaction or a value cannot be written in, the UPDATE alone and
//! bound, `after_save`, then `COMMIT`; a lost reply resolved with the evidence taken before the
//! flight left.

use std::{sync::Arc, time::Duration};

use sea_orm::{
    ConnectionTrait, DbBackend, FromQueryResult, ModelTrait, sea_query::InsertStatement,
};
use tracing::{debug, warn};

use super::text::stored_of;
use crate::{
    commit::{Evidence, Resolution, write_error},
    db::{
        deadline::{Bounded, within},
        failure::in_doubt,
        pinned::Pinned,
    },
    error::{Error, Result, database},
    identity_map::Change,
    write::entity::Writable,
    write::row_sql::{self as write, ColumnValue},
    write::row_step::RowStep,
};

/// The attempt's evidence of commit, known before flight 2 leaves (`None`:
/// `commit_markers(false)`, a lost reply is [`Error::CommitUnknown`]), and whether it is a marker
/// whose INSERT rides in the UPDATE (no `freshlock_incarnation`; a marker the evidence wrote
/// itself, for a new incarnation, is in the transaction already).
pub(super) struct Taken {
    pub(super) evidence: Option<Evidence>,
    pub(super) rides: bool,
}

impl Taken {
    /// The marker's INSERT the UPDATE's message carries, on `backend`.
    pub(super) fn insert(&self, backend: DbBackend) -> Option<InsertStatement> {
        match (&self.evidence, self.rides) {
            (Some(Evidence::Marker(marker)), true) => Some(marker.insert(backend, true)),
            _ => None,
        }
    }
}

/// What flight 2 needs.
pub(super) struct Write<'s, E: Writable> {
    pub(super) step: &'s mut RowStep<E>,
    pub(super) reply: Duration,
    pub(super) taken: Taken,
    pub(super) original: E::Model,
    pub(super) changes: Vec<ColumnValue<E>>,
    pub(super) expected: Vec<ColumnValue<E>>,
}

/// How flight 2 ended, when it did not fail.
pub(super) enum Done<M> {
    /// Committed: the row `after_save` reported, and the cache's change.
    Stored(M, Change),
    /// The guard refused: nothing was written.
    Refused,
    /// A served waiter's `after_save` failed in the transaction (it got its error): rolled
    /// back, and run again without it.
    Again,
    /// Committed, but `after_save` failed after the commit: its error, and the cache's change.
    AfterSave(Error, Change),
}

/// Flight 2's end and the evidence the transaction held (for the marker's sweep).
pub(super) type Ended<M> = (Done<M>, Option<Evidence>);

impl<E: Writable> Write<'_, E> {
    /// Flight 2 as one message: `UPDATE … RETURNING …; COMMIT`, then `after_save`.
    pub(super) async fn in_one_message(
        mut self,
        conn: Pinned,
        text: String,
    ) -> Result<Ended<E::Model>> {
        let row = &self.step.row;
        let backend = conn.get_database_backend();
        let sent = within(self.reply, conn.flight(format!("{text}; COMMIT"))).await;
        let updated = match sent.and_then(|mut replies| stored_of(backend, &mut replies)) {
            Ok(updated) => updated,
            Err(e) if in_doubt(&e) => {
                // Closed first: the server ends the transaction if the COMMIT never came.
                drop(conn);
                return self.resolve(e, None).await;
            }
            Err(e) => return Err(database("writing", row, e)),
        };
        // Committed: the UPDATE's row, or none when the guard refused (nothing was written).
        let Some(updated) = updated else {
            debug!(row = %row.name, "the guard refused the write");
            conn.release();
            return Ok((Done::Refused, self.taken.evidence));
        };
        let stored = match E::Model::from_query_result(&updated, "") {
            Ok(stored) => stored,
            Err(e) => {
                // Committed, but the row could not be read: the cache forgets it, the caller
                // gets the row as written.
                warn!(row = %row.name, error = %e, "the committed row could not be read back");
                conn.release();
                let (written, evict) = self.written()?;
                self.step.tell(Arc::new(written.clone()), Vec::new());
                return Ok((Done::Stored(written, evict), self.taken.evidence));
            }
        };
        let stored = Arc::new(stored);
        let cached = Change::cache(row.key.clone(), Arc::clone(&stored));
        let bounded = Bounded::new(&conn, self.reply);
        let done = match write::after_save::<E, _>((*stored).clone(), &bounded, false).await {
            Ok(reported) => Done::Stored(reported, cached),
            Err(e) => {
                let error = database("running after_save (after the commit) for", row, e);
                Done::AfterSave(error, cached)
            }
        };
        // Each served waiter's own `after_save`, after the commit too.
        let theirs = match self.step.batch.as_mut() {
            None => Vec::new(),
            Some(batch) => batch.after_saves_committed(&stored, &bounded, row).await,
        };
        // A hook's statement without reply leaves one unread: the connection is closed then.
        if !bounded.went_silent() {
            conn.release();
        }
        self.step.tell(stored, theirs);
        Ok((done, self.taken.evidence))
    }

    /// Flight 2 in three: the UPDATE alone and bound (the hooks wrote in the transaction, or a
    /// value cannot be written in), `after_save` in the transaction, then `COMMIT` or, when the
    /// guard refused, `ROLLBACK`.
    pub(super) async fn then_commit(
        mut self,
        conn: Pinned,
        update: sea_orm::Statement,
    ) -> Result<Ended<E::Model>> {
        let row = &self.step.row;
        let updated = match conn.get_database_backend() {
            DbBackend::MySql => {
                // The marker's INSERT, the UPDATE and the read back, bound (`row_sql`).
                let sending = write::Sending {
                    db: self.step.session.pool(),
                    markers: self.taken.evidence.is_some(),
                    reply: self.reply,
                    lease: None,
                };
                let (original, changes) = (&self.original, &self.changes);
                let updated = write::update_with_evidence::<E, _>(
                    &conn,
                    sending,
                    original,
                    changes,
                    &self.expected,
                );
                match updated.await {
                    Ok((stored, evidence)) => {
                        self.taken.evidence = evidence;
                        Ok(stored)
                    }
                    Err((_, e)) => Err(e),
                }
            }
            _ => within(self.reply, conn.query_one_raw(update))
                .await
                .and_then(|updated| {
                    (updated.as_ref())
                        .map(|updated| E::Model::from_query_result(updated, ""))
                        .transpose()
                }),
        };
        let stored = match updated {
            Ok(stored) => stored,
            Err(e) => return Err(database("writing", row, e)),
        };
        let Some(stored) = stored else {
            if within(self.reply, conn.flight("ROLLBACK".to_owned()))
                .await
                .is_ok()
            {
                conn.release();
            }
            return Ok((Done::Refused, None));
        };
        let bounded = Bounded::new(&conn, self.reply);
        let reported = match write::after_save::<E, _>(stored.clone(), &bounded, false).await {
            Ok(reported) => reported,
            Err(e) => return Err(database("running after_save for", row, e)),
        };
        // Each served waiter's own `after_save`, in the transaction: one that fails got its
        // error, and the attempt runs again without it.
        let theirs = match self.step.batch.as_mut() {
            None => Vec::new(),
            Some(batch) => match batch.after_saves(&stored, &bounded, row).await {
                Some(theirs) => theirs,
                None => return Ok((Done::Again, None)),
            },
        };
        match within(self.reply, conn.flight("COMMIT".to_owned())).await {
            Ok(_) => {
                conn.release();
                let stored = Arc::new(stored);
                let cached = Change::cache(row.key.clone(), Arc::clone(&stored));
                self.step.tell(stored, theirs);
                Ok((Done::Stored(reported, cached), self.taken.evidence))
            }
            Err(e) if in_doubt(&e) => {
                // Closed first: the server ends the transaction if the COMMIT never came.
                drop(conn);
                self.resolve(e, Some(reported)).await
            }
            Err(e) => Err(database("committing", row, e)),
        }
    }

    /// Flight 2's reply was lost with its `COMMIT`: resolved with the evidence on another
    /// connection. Committed: `reported`, or the row as this write made it (see the module
    /// docs), and the cache forgets the row.
    async fn resolve(
        &mut self,
        lost: sea_orm::DbErr,
        reported: Option<E::Model>,
    ) -> Result<Ended<E::Model>> {
        let label = self.step.row.name.as_str();
        let Some(evidence) = &self.taken.evidence else {
            return Err(write_error("committing", label, lost));
        };
        warn!(target = label, error = %lost, "the commit's reply was lost: resolving on another connection");
        let db = self.step.session.pool();
        match evidence.resolve(db, label, self.reply).await? {
            Resolution::Committed => {
                let evict = Change::Evict(self.step.row.key.clone());
                let reported = match reported {
                    Some(reported) => reported,
                    None => self.written()?.0,
                };
                self.step.tell(Arc::new(reported.clone()), Vec::new());
                Ok((Done::Stored(reported, evict), None))
            }
            Resolution::Absent => Err(database("committing", &label, lost)),
        }
    }

    /// The row as this write made it (the reloaded row with its changes), and the cache's
    /// forgetting of it.
    fn written(&self) -> Result<(E::Model, Change)> {
        let mut model = self.original.clone();
        for (column, value) in &self.changes {
            (model.try_set(*column, value.clone()))
                .map_err(|e| database("reading back", &self.step.row, e))?;
        }
        Ok((model, Change::Evict(self.step.row.key.clone())))
    }
}
