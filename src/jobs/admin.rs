//! What an operator does to the queue (`freshlock jobs`): retrying or discarding one job, and
//! pruning finished ones (what the queue holds: `query.rs`).

use std::time::Duration;

use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, Value};

use super::{job::JobId, query::text, state::Stored, store};
use crate::{
    database::Db,
    db::{
        autocommit::{autocommit, upkeep},
        deadline::{Bounded, DEFAULT_REPLY, Work},
        own::{Own, rollback},
    },
    error::{Result, database},
    lock::sql::{millis, now_ms, statement},
    schema::JOB_TABLE,
};

/// What [`retry`] did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retried {
    /// The failed job waits again, due now, with its attempts counted from zero.
    Waiting,
    /// No failed job has this id.
    NotFailed,
    /// Its unique key is held by another job that has not finished: it was left failed.
    Duplicate,
}

/// What [`retry`] and [`discard`] do, as their errors say.
const RETRYING: &str = "retrying a job of";
const DISCARDING: &str = "discarding a job of";

/// Makes failed job `id` wait again, due now, its attempts counted from zero (its last error
/// is kept until it runs). Its unique key is taken back, unless another unfinished job holds it.
///
/// # Errors
/// [`crate::Error::Database`] when the database fails.
pub async fn retry(db: impl Into<Db>, id: JobId) -> Result<Retried> {
    let keep = |retried: &Retried| *retried == Retried::Waiting;
    decided(db, RETRYING, |txn| Box::pin(retry_in(txn, id)), keep).await
}

/// Runs `work` in a transaction of its own on `db`, committed when `keep` says so of its value
/// and rolled back otherwise.
pub(super) async fn decided<T>(
    db: impl Into<Db>,
    operation: &'static str,
    work: impl for<'t> FnMut(&'t Bounded<'t, DatabaseTransaction>) -> Work<'t, T>,
    keep: impl FnOnce(&T) -> bool,
) -> Result<T> {
    let db = db.into();
    let own = Own::new(db.pool(), DEFAULT_REPLY);
    let fail = |e| database(operation, &JOB_TABLE, e);
    let (txn, value) = own.open(work).await.map_err(fail)?;
    if keep(&value) {
        own.commit(txn).await.map_err(fail)?;
    } else {
        rollback(txn, own.reply()).await;
    }
    Ok(value)
}

/// [`retry`] in `db`'s transaction.
async fn retry_in(db: &impl ConnectionTrait, id: JobId) -> std::result::Result<Retried, DbErr> {
    let backend = db.get_database_backend();
    let read = format!("SELECT unique_key FROM {JOB_TABLE} WHERE id = ? AND state = ?");
    let values = vec![id.into(), Stored::Failed.into()];
    let Some(row) = db.query_one_raw(statement(backend, &read, values)).await? else {
        return Ok(Retried::NotFailed);
    };
    let unique: Option<String> = text(row.try_get("", "unique_key")?);
    if let Some(unique) = &unique
        && store::holder_of(db, unique).await?.is_some()
    {
        return Ok(Retried::Duplicate);
    }
    let now = now_ms(backend);
    let sql = format!(
        "UPDATE {JOB_TABLE} SET state = {pending}, attempts = 0, run_at = {now}, \
         finished_at = NULL, unique_hash = ? WHERE id = ? AND state = {failed}",
        pending = Stored::Pending,
        failed = Stored::Failed,
    );
    let values = vec![Value::Bytes(unique.as_deref().map(store::hash)), id.into()];
    match db.execute_raw(statement(backend, &sql, values)).await {
        Ok(done) if done.rows_affected() == 1 => Ok(Retried::Waiting),
        Ok(_) => Ok(Retried::NotFailed),
        // Taken by a job enqueued between the two statements.
        Err(e) if crate::db::failure::is_unique_violation(&e) => Ok(Retried::Duplicate),
        Err(e) => Err(e),
    }
}

/// Discards waiting job `id` before it runs: `true` when it was waiting (a job that is running
/// now is waited for; if it completes, it is not discarded). Its unique key is free again.
///
/// # Errors
/// [`crate::Error::Database`] when the database fails.
pub async fn discard(db: impl Into<Db>, id: JobId) -> Result<bool> {
    let keep = |discarded: &bool| *discarded;
    decided(db, DISCARDING, |txn| Box::pin(discard_in(txn, id)), keep).await
}

/// [`discard`] in `db`'s transaction.
async fn discard_in(db: &impl ConnectionTrait, id: JobId) -> std::result::Result<bool, DbErr> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let sql = format!(
        "UPDATE {JOB_TABLE} SET state = {discarded}, finished_at = {now}, unique_hash = NULL \
         WHERE id = ? AND state IN ({pending}, {queued})",
        discarded = Stored::Discarded,
        pending = Stored::Pending,
        queued = Stored::Queued,
    );
    let done = db
        .execute_raw(statement(backend, &sql, vec![id.into()]))
        .await?;
    if done.rows_affected() != 1 {
        return Ok(false);
    }
    // The next job of its key may run now.
    let read = format!("SELECT key_hash FROM {JOB_TABLE} WHERE id = ?");
    let row = db
        .query_one_raw(statement(backend, &read, vec![id.into()]))
        .await?;
    let key: Option<Vec<u8>> = match row {
        Some(row) => row.try_get("", "key_hash")?,
        None => None,
    };
    store::promote(db, key.into_iter().collect(), &[]).await?;
    Ok(true)
}

/// How many finished jobs one statement of [`prune`] deletes at most: each batch commits on its
/// own, so a large prune never holds many row locks, nor one transaction open for long.
const PRUNE_BATCH: u32 = 1_000;

/// Which finished jobs [`prune`] deletes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Prune {
    /// Done, discarded and cancelled jobs; failed ones keep their error for
    /// [`list`](super::list) and can be [`retry`]-ed.
    Finished,
    /// Done, discarded, cancelled and failed jobs.
    FinishedAndFailed,
}

/// Deletes the jobs that finished `older_than` ago or earlier (database clock; `Duration::ZERO`:
/// every finished job), as `which` says. Returns how many it deleted.
///
/// Finished jobs stay in the table until pruned ([operations](crate::guide::operations)).
/// Waiting and leased jobs are never touched, and neither a key's order nor a unique key
/// depends on finished jobs, so a prune may run while workers do: it locks only the jobs it
/// deletes. It deletes in batches of 1,000, each a read of the batch and a `DELETE` of its rows,
/// statements of their own (each in a transaction of its own behind a transaction pooler); a
/// prune that fails part-way keeps what its earlier batches deleted. It also forgets requests to
/// stop jobs ([`cancel`](super::cancel)) that finished first, and the tokens of rate limits
/// ([`Limit`](super::Limit)) that have been free for `older_than` (a per-key rate keeps a few
/// rows per key it met).
///
/// # Errors
/// [`crate::Error::Database`] when a statement fails.
pub async fn prune(db: impl Into<Db>, older_than: Duration, which: Prune) -> Result<u64> {
    let fail = |e| database("pruning finished jobs of", &JOB_TABLE, e);
    let db = db.into();
    let pool = db.pool();
    let db = &autocommit(pool);
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    // Requests to stop jobs that finished first (they committed before the request was seen).
    store::forget_finished(db).await.map_err(fail)?;
    store::forget_unused(db.0, millis(older_than))
        .await
        .map_err(fail)?;
    let mut states = vec![Stored::Done, Stored::Discarded, Stored::Cancelled];
    if which == Prune::FinishedAndFailed {
        states.push(Stored::Failed);
    }
    let states = states
        .iter()
        .map(Stored::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    // A read of the batch (a snapshot: no locks; `freshlock_job_next`, state first, finds the
    // finished jobs), then a `DELETE` of those rows by id. One `DELETE … WHERE id IN (SELECT …)`
    // locked every row it read on MariaDB and waited for a running job's row, while takes
    // skipped the rows it held (see `store::sweep`). A job that is no longer finished by the
    // time of the `DELETE` (retried meanwhile) is kept by its `state` condition.
    let find = format!(
        "SELECT id FROM {JOB_TABLE} WHERE state IN ({states}) AND finished_at <= {now} - ? \
         LIMIT {PRUNE_BATCH}"
    );
    let older = millis(older_than);
    let mut pruned = 0;
    loop {
        let rows = db
            .query_all_raw(statement(backend, &find, vec![older.into()]))
            .await
            .map_err(fail)?;
        let ids = (rows.iter())
            .map(|row| row.try_get::<i64>("", "id").map(Value::from))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(fail)?;
        if ids.is_empty() {
            return Ok(pruned);
        }
        let placeholders = vec!["?"; ids.len()].join(", ");
        // By primary key on MySQL too: it scans a small table whole even for `id IN (…)`, and
        // a `DELETE` waits for every locked row it reads, at READ COMMITTED as well (only an
        // `UPDATE` passes over one that does not match).
        let delete = if backend == DbBackend::MySql {
            format!(
                "DELETE j FROM {JOB_TABLE} j FORCE INDEX (PRIMARY) \
                 WHERE j.state IN ({states}) AND j.id IN ({placeholders})"
            )
        } else {
            format!("DELETE FROM {JOB_TABLE} WHERE state IN ({states}) AND id IN ({placeholders})")
        };
        pruned += upkeep(db.0, statement(backend, &delete, ids))
            .await
            .map_err(fail)?;
        if rows.len() < PRUNE_BATCH as usize {
            return Ok(pruned);
        }
    }
}
