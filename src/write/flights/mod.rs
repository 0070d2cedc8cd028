//! `locked_update` in two round trips ([`crate::SessionBuilder::two_flights`]): flight 1 sends
//! `BEGIN` and the reload, which on PostgreSQL also reads the commit's evidence (the
//! transaction's id) and tries a `pg_advisory` or `row` lock as the engine's reload does
//! (`fold.rs`: a failed try sends the write on to the engine); flight 2 sends the guarded UPDATE
//! and `COMMIT` — on PostgreSQL `UPDATE … RETURNING`, on MySQL/MariaDB the commit marker's
//! INSERT, the UPDATE and the read of the row back. Both on a connection freshlock holds
//! (`db/pinned.rs`), as text messages with their values written in (`db/inline/`).
//!
//! Why not the engine's transaction: sea-orm's waits for its `BEGIN`'s reply and sends its
//! `COMMIT` alone, so a write there is four round trips (see `pinned.rs`). What the engine does
//! around a step is the same here and comes from the same places: the attempts and their
//! backoff ([`Retries`]), the reload's statement (`row.rs`), the hooks, the primary-key check and
//! the changed columns (`row_write::changes`), the guard (`row_write::expected`), the UPDATE
//! (`row_sql::returning_statement`), the evidence ([`Plan`]) and its resolution after a lost
//! reply ([`Evidence::resolve`]), the cache's effects.
//!
//! Where the rules differ, because the `COMMIT` rides with the `UPDATE`:
//! - the evidence must be known before flight 2 leaves (its reply may be lost), so the reload
//!   reads the transaction's id (a `SELECT … FOR UPDATE` has one already), or a marker's INSERT
//!   rides in flight 2 (a CTE of the UPDATE on PostgreSQL, a statement before it on
//!   MySQL/MariaDB);
//! - a guard's refusal finds the transaction committed: it wrote nothing but the marker, since
//!   the UPDATE matched no row and no hook wrote (a write whose `before_save` sent a statement
//!   sends its UPDATE alone, decides, then commits or rolls back);
//! - `after_save` runs after the commit; an error of it is the call's error but the write stands
//!   (it is not run again);
//! - a commit whose reply was lost and is resolved as committed reports the row as the write
//!   made it (its reply, with any change the database made, was lost): the session's cache
//!   forgets the row instead of caching it.
//!
//! The connection goes back to the pool only after a transaction that ended cleanly; on any
//! other way out it is closed (see `pinned.rs`), and the server rolls back what it held.

mod second;
mod text;

use second::{Done, Taken, Write};
use text::{key_written_in, message, reload_statement};

use std::{sync::Arc, time::Duration};

use sea_orm::{DbBackend, FromQueryResult};

use crate::{
    commit::{Evidence, Marker, Plan},
    db::{
        deadline::{Bounded, within},
        pinned::Pinned,
        prepared::{Prepared, short},
    },
    error::{Error, Result, database},
    identity_map::Change,
    write::combine::Batch,
    write::decision::{Decision, Written},
    write::engine::{Retries, Step, Tried},
    write::entity::Writable,
    write::locking::{Fold, Locking},
    write::row_sql as write,
    write::row_step::RowStep,
    write::row_write,
};

/// Whether `step`'s write under `lockings` goes in two flights: asked for, on a PostgreSQL or
/// MySQL/MariaDB pool,
/// an update of an existing row under one lock that sends nothing in the transaction (`local`)
/// or that its reload tries (`pg_advisory`, `row`), and its key written into the reload's text.
/// A combined write's holder serves its waiters here as in the engine (`combine.rs`).
pub(crate) fn applies<E: Writable>(step: &RowStep<E>, lockings: &[Locking]) -> bool {
    let session = &step.session;
    let db = session.pool();
    let lock = matches!(lockings, [locking] if locking.asks_nothing_of_the_transaction() || folds(locking));
    session.two_flights()
        && db.is_real()
        && matches!(
            db.get_database_backend(),
            DbBackend::Postgres | DbBackend::MySql
        )
        && step.updates_only()
        && lock
        && read_exactly_as_text::<E>(db.get_database_backend())
        && key_written_in(db.get_database_backend(), step.row.pk())
}

/// Whether every column of `E` reads back the same in a text reply as in a bound one on
/// `backend`. Not a `FLOAT` column on MySQL/MariaDB, which the text protocol writes with six
/// significant digits (`3.40282e38` for `f32::MAX`): the reload would not read what is stored,
/// and the guard would never match it. (PostgreSQL writes the shortest exact digits.)
fn read_exactly_as_text<E: Writable>(backend: DbBackend) -> bool {
    use sea_orm::{ColumnTrait, ColumnType, Iterable};
    backend != DbBackend::MySql
        || !E::Column::iter().any(|column| *column.def().get_column_type() == ColumnType::Float)
}

/// Whether `locking` is a `pg_advisory` or `row` lock its reload may try (see `fold.rs`): then
/// flight 1 tries it in the reload, as the engine's first statement does.
fn folds(locking: &Locking) -> bool {
    locking.in_transaction && locking.guard.is_none() && locking.fold == Fold::Allowed
}

/// Runs `step`'s attempts in two flights until one settles, as `retries` says; `None` when a
/// lock tried by the reload was not had (busy, or there is no row: the statement cannot tell):
/// the write goes on in the engine, its lock taken by a statement of its own.
pub(crate) async fn run<E: Writable>(
    step: &mut RowStep<E>,
    locking: &mut Locking,
    retries: &mut Retries,
) -> Option<Result<Written<E::Model>>> {
    loop {
        retries.start();
        match attempt(step, locking).await {
            Attempt::Settle(tried) => {
                if let Some(result) = retries.settle(tried).await {
                    return Some(result);
                }
            }
            Attempt::Final(result) => return Some(result),
            Attempt::Unfolded => {
                // Not an attempt of the write (see `Tried::Uncounted`).
                retries.settle(Ok(Tried::<()>::Uncounted)).await;
                step.unfold();
                return None;
            }
        }
    }
}

/// How one attempt ended.
enum Attempt<M> {
    /// As an engine's attempt does: [`Retries::settle`] decides.
    Settle(Result<Tried<Written<M>>>),
    /// Ended, committed or with nothing to write: the result (an `after_save` that failed after
    /// the commit included), never run again.
    Final(Result<Written<M>>),
    /// The lock tried by the reload was not had: nothing was read, locked or written.
    Unfolded,
}

/// One attempt: flight 1, the caller's decision, flight 2.
async fn attempt<E: Writable>(step: &mut RowStep<E>, locking: &mut Locking) -> Attempt<E::Model> {
    let settle = |error: Error| Attempt::Settle(Ok(Tried::failed(error)));
    let session = step.session.clone();
    let (db, reply) = (session.pool(), session.policy().reply_deadline());
    session.map().remove(&step.row.key);
    let backend = db.get_database_backend();
    // Read before the connection is held: the first write of a pool asks the server's default
    // isolation on a connection of its own (a pool of one would wait for itself).
    let begin = crate::db::begin::text(db).await;
    let acquired = Pinned::acquire(db.connection(), db.transaction_pooled()).await;
    let conn = match acquired {
        Some(Ok(conn)) => conn,
        Some(Err(e)) => return settle(database("beginning the transaction for", &step.row, e)),
        None => {
            let e = sea_orm::DbErr::Custom(format!("no two flights on {backend:?}"));
            return settle(database("beginning the transaction for", &step.row, e));
        }
    };
    // The evidence's plan is known before the transaction (a pool asks once whether
    // `freshlock_incarnation` exists, outside it).
    let plan = match session.commit_markers() {
        true => Some(Plan::of(db, &conn).await),
        false => None,
    };
    let stamps = match &plan {
        Some(Plan::Stamped(stamped)) => stamped.exprs(),
        _ => &[],
    };
    // A `pg_advisory` or `row` lock is tried by the reload (`fold.rs`).
    let folded = folds(locking).then(|| {
        locking.fold = Fold::Pending;
        locking.folding()
    });
    let folded = folded.flatten();
    // The reload and the UPDATE by name where the connection prepares them (`prepared/`).
    let prepared = Prepared::new(db.prepares());
    let reload = reload_statement::<E>(step, backend, stamps, folded.as_ref());
    let Some(reload) = reload.and_then(|reload| prepared.text(&reload)) else {
        // Nothing begun on it yet (`applies` checked the key, so this does not happen).
        conn.release();
        let e = sea_orm::DbErr::Custom("the reload's key could not be written in".into());
        return settle(database("reloading", &step.row, e));
    };

    // Flight 1: BEGIN and the reload (with the transaction's id).
    let started = tokio::time::Instant::now();
    let read = within(reply, prepared.begin(&conn, begin, Some(&reload), None)).await;
    let row = match read.and_then(|(reloaded, _)| reloaded.ok_or_else(short)) {
        Ok(reloaded) => reloaded.rows.into_iter().next(),
        Err(e) => {
            return settle(database("reloading", &step.row, e));
        }
    };
    if folded.is_some() {
        locking.folded(row.is_some(), started.elapsed());
        if row.is_none() {
            if within(reply, conn.flight("ROLLBACK".to_owned()))
                .await
                .is_ok()
            {
                conn.release();
            }
            return Attempt::Unfolded;
        }
    }
    let found = match row.as_ref().map(|row| E::Model::from_query_result(row, "")) {
        None => None,
        Some(Ok(model)) => Some(model),
        Some(Err(e)) => {
            return settle(database("reloading", &step.row, e));
        }
    };
    let (evidence, rides) = match (plan, &row) {
        (Some(Plan::Stamped(stamped)), Some(row)) => {
            match within(reply, stamped.evidence(&conn, db, row)).await {
                Ok(evidence) => (Some(evidence), false),
                Err(e) => {
                    return settle(database("marking the commit of", &step.row, e));
                }
            }
        }
        (Some(Plan::Marker), _) => (Some(Evidence::Marker(Marker::new())), true),
        _ => (None, false),
    };
    let taken = Taken { evidence, rides };

    // The caller decides, as in the engine's row step.
    if step.reloaded.send(found).await.is_err() {
        return settle(step.interrupted());
    }
    let Some(decision) = step.decisions.recv().await else {
        return settle(step.interrupted());
    };
    let (original, draft) = match decision {
        Decision::Update { original, draft } => (original, draft),
        Decision::Keep(original) => {
            let kept = Written::Unchanged(Arc::new(original));
            return keep(step, locking, conn, reply, kept).await;
        }
        Decision::NotFound => return keep(step, locking, conn, reply, Written::NotFound).await,
        Decision::Insert(_) | Decision::Delete(_) => {
            let e = sea_orm::DbErr::Custom("only updates are written in two flights".into());
            return settle(database("writing", &step.row, e));
        }
    };
    let before = conn.sent();
    let bounded = Bounded::new(&conn, reply);
    let changes = row_write::changes::<E, _>(&bounded, &step.row, &original, draft).await;
    let mut changes = match changes {
        Ok(changes) => changes,
        Err(error) => {
            return settle(error);
        }
    };
    // Only a holder that excludes the process's other writers of the row may serve them (as in
    // the engine's row step).
    if let Some(room) = step.room.clone().filter(|_| locking.excludes_process()) {
        let batch = step.batch.get_or_insert_with(|| Batch::take(&room));
        match batch
            .serve(&bounded, &original, &mut changes, &step.row)
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                return Attempt::Settle(Ok(Tried::Uncounted));
            }
            Err(e) => {
                return settle(database("combining writes of", &step.row, e));
            }
        }
    }
    if changes.is_empty() {
        let original = Arc::new(original);
        step.tell(Arc::clone(&original), Vec::new());
        return keep(step, locking, conn, reply, Written::Unchanged(original)).await;
    }
    let version = session.version_of::<E>();
    let expected = match row_write::expected::<E>(version, &original, &mut changes) {
        Ok(expected) => expected,
        Err(error) => {
            return settle(error);
        }
    };
    // The UPDATE's message: on PostgreSQL `UPDATE … RETURNING …` (behind a marker's INSERT when
    // one rides); on MySQL/MariaDB the marker's INSERT, the UPDATE and the read of the row back.
    let marker = taken.insert(backend);
    let update = match backend {
        DbBackend::Postgres => {
            write::returning_statement::<E>(&original, &changes, &expected, marker.clone())
        }
        _ => write::update_statement::<E>(backend, &original, &changes, &expected),
    };
    let update = match update {
        Ok(update) => update,
        Err(e) => {
            return settle(database("writing", &step.row, e));
        }
    };
    // Hooks that wrote in the transaction keep their order: the UPDATE alone, then the commit.
    let text = (conn.sent() == before)
        .then(|| message::<E>(&prepared, backend, &update, marker.as_ref(), step.row.pk()))
        .flatten();
    let write = Write {
        step: &mut *step,
        reply,
        taken,
        original,
        changes,
        expected,
    };
    let done = match text {
        Some(text) => write.in_one_message(conn, text).await,
        None => write.then_commit(conn, update).await,
    };
    let (done, evidence) = match done {
        Ok(done) => done,
        Err(error) => {
            // A commit in doubt is in doubt for every write it carried (`Step::ended`).
            let ended = Err(error);
            step.ended(std::slice::from_ref(locking), &ended);
            return Attempt::Settle(ended.map(|()| Tried::Uncounted));
        }
    };
    let (result, effect) = match done {
        Done::Refused => return Attempt::Settle(Ok(Tried::conflict(step.row.to_string()))),
        Done::Again => return Attempt::Settle(Ok(Tried::Uncounted)),
        Done::Stored(reported, effect) => (Ok(Written::Updated(Arc::new(reported))), effect),
        // Committed: the write stands, and is not run again.
        Done::AfterSave(error, effect) => (Err(error), effect),
    };
    locking.committed();
    session.map().apply([effect]);
    step.ended(std::slice::from_ref(locking), &Ok(()));
    if let Some(evidence) = &evidence {
        crate::commit::committed(evidence, db, reply).await;
    }
    Attempt::Final(result)
}

/// Ends a transaction that writes nothing (`COMMIT`, one round trip), then caches what the
/// caller kept and tells the served waiters, if any.
async fn keep<E: Writable>(
    step: &mut RowStep<E>,
    locking: &Locking,
    conn: Pinned,
    reply: Duration,
    kept: Written<E::Model>,
) -> Attempt<E::Model> {
    if let Err(e) = within(reply, conn.flight("COMMIT".to_owned())).await {
        return Attempt::Settle(Ok(Tried::failed(database("committing", &step.row, e))));
    }
    conn.release();
    if let Written::Unchanged(original) = &kept {
        let cached = Change::cache(step.row.key.clone(), Arc::clone(original));
        step.session.map().apply([cached]);
    }
    step.ended(std::slice::from_ref(locking), &Ok(()));
    Attempt::Final(Ok(kept))
}
