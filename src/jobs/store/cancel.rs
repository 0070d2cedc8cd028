//! Cancelling jobs in the table: a job nobody holds (waiting, or leased: its work runs outside
//! any transaction) is cancelled at once; a job running in a worker's transaction, whose row
//! that transaction locks, gets a request in `freshlock_job_cancel`, which its completion reads
//! ([`super::complete`]).

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Value};

use crate::jobs::state::{
    Stored::{self, Cancelled},
    UNFINISHED,
};
use crate::{
    lock::sql::{now_ms, statement},
    schema::{JOB_CANCEL_TABLE, JOB_TABLE, insert_ignore},
};

/// What [`look`] found of a job.
pub(crate) enum Found {
    /// Unfinished and not locked by anyone: locked now, in the caller's transaction.
    Free,
    /// Unfinished, its row locked by another transaction: running in a worker's transaction
    /// (or being taken, finished or cancelled right now).
    Busy,
    /// Finished (done, failed, discarded or cancelled), or no such job.
    Finished,
}

/// Looks at job `id` in `txn`, locking its row when nobody else holds it (`SKIP LOCKED`;
/// SQLite has one writer, so there nobody else holds it).
pub(crate) async fn look(txn: &impl ConnectionTrait, id: i64) -> Result<Found, DbErr> {
    let lock = match txn.get_database_backend() {
        DbBackend::Sqlite => "",
        _ => " FOR UPDATE SKIP LOCKED",
    };
    if let Some(state) = state_of(txn, id, lock).await? {
        return Ok(match UNFINISHED.contains(state) {
            true => Found::Free,
            false => Found::Finished,
        });
    }
    // Skipped, or missing: a plain read tells the two apart.
    Ok(match state_of(txn, id, "").await? {
        Some(state) if UNFINISHED.contains(state) => Found::Busy,
        _ => Found::Finished,
    })
}

/// The stored state of job `id`, read with `lock` (a locking clause, or `""`): `None` when there
/// is no such job, or when the lock skipped it.
async fn state_of(
    txn: &impl ConnectionTrait,
    id: i64,
    lock: &str,
) -> Result<Option<Stored>, DbErr> {
    let backend = txn.get_database_backend();
    let read = format!("SELECT state FROM {JOB_TABLE} WHERE id = ?{lock}");
    let row = txn
        .query_one_raw(statement(backend, &read, vec![id.into()]))
        .await?;
    match row {
        Some(row) => Ok(Stored::from_code(row.try_get("", "state")?)),
        None => Ok(None),
    }
}

/// A job [`cancel`] cancelled.
pub(crate) struct CancelledJob {
    /// Its kind, as stored.
    pub(crate) kind: Vec<u8>,
    /// Its key's hash, if it has a key: the key's next job may run now.
    pub(crate) key_hash: Option<Vec<u8>>,
    /// Its attempts counted so far (an attempt rolled back is not counted).
    pub(crate) attempts: i32,
}

/// Marks job `id` cancelled if it has not finished (its claim, if leased, ended; its unique key
/// free) and forgets any request to stop it: what it cancelled, `None` when the job had
/// finished.
pub(crate) async fn cancel(
    txn: &impl ConnectionTrait,
    id: i64,
) -> Result<Option<CancelledJob>, DbErr> {
    let backend = txn.get_database_backend();
    let now = now_ms(backend);
    let sql = format!(
        "UPDATE {JOB_TABLE} SET state = {Cancelled}, finished_at = {now}, owner = NULL, \
         lease_until = NULL, unique_hash = NULL WHERE id = ? AND state IN ({UNFINISHED})"
    );
    let done = txn
        .execute_raw(statement(backend, &sql, vec![id.into()]))
        .await?;
    forget(txn, &[id]).await?;
    if done.rows_affected() != 1 {
        return Ok(None);
    }
    let read = format!("SELECT kind, key_hash, attempts FROM {JOB_TABLE} WHERE id = ?");
    let Some(row) = txn
        .query_one_raw(statement(backend, &read, vec![id.into()]))
        .await?
    else {
        return Ok(None);
    };
    Ok(Some(CancelledJob {
        kind: row.try_get("", "kind")?,
        key_hash: row.try_get("", "key_hash")?,
        attempts: row.try_get("", "attempts")?,
    }))
}

/// Whether job `id` was cancelled.
pub(crate) async fn is_cancelled(txn: &impl ConnectionTrait, id: i64) -> Result<bool, DbErr> {
    Ok(state_of(txn, id, "").await? == Some(Cancelled))
}

/// Asks the worker running job `id` in its transaction to stop: its completion will find this
/// request and roll back (see [`super::complete`]).
pub(crate) async fn request(txn: &impl ConnectionTrait, id: i64) -> Result<(), DbErr> {
    let backend = txn.get_database_backend();
    let now = now_ms(backend);
    let sql = insert_ignore(
        backend,
        JOB_CANCEL_TABLE,
        "job_id, requested_at",
        &format!("?, {now}"),
    );
    txn.execute_raw(statement(backend, &sql, vec![id.into()]))
        .await
        .map(drop)
}

/// Which of jobs `ids` have a request to stop.
pub(crate) async fn requested(txn: &impl ConnectionTrait, ids: &[i64]) -> Result<Vec<i64>, DbErr> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let read = requested_statement(txn.get_database_backend(), ids);
    read_requested(&txn.query_all_raw(read).await?)
}

/// [`requested`]'s statement (`ids` not empty), for a message of several statements.
pub(crate) fn requested_statement(backend: DbBackend, ids: &[i64]) -> sea_orm::Statement {
    let placeholders = vec!["?"; ids.len()].join(", ");
    let sql = format!("SELECT job_id FROM {JOB_CANCEL_TABLE} WHERE job_id IN ({placeholders})");
    let values = ids.iter().map(|&id| Value::from(id)).collect();
    statement(backend, &sql, values)
}

/// The jobs [`requested_statement`]'s `rows` name.
pub(crate) fn read_requested(rows: &[sea_orm::QueryResult]) -> Result<Vec<i64>, DbErr> {
    rows.iter().map(|row| row.try_get("", "job_id")).collect()
}

/// Deletes the requests to stop jobs `ids`.
async fn forget(txn: &impl ConnectionTrait, ids: &[i64]) -> Result<(), DbErr> {
    let backend = txn.get_database_backend();
    let placeholders = vec!["?"; ids.len()].join(", ");
    let sql = format!("DELETE FROM {JOB_CANCEL_TABLE} WHERE job_id IN ({placeholders})");
    let values = ids.iter().map(|&id| Value::from(id)).collect();
    txn.execute_raw(statement(backend, &sql, values))
        .await
        .map(drop)
}

/// Deletes the requests whose jobs finished (they committed before the request was seen, or
/// were pruned): how many.
pub(crate) async fn forget_finished(db: &impl ConnectionTrait) -> Result<u64, DbErr> {
    let backend = db.get_database_backend();
    let sql = format!(
        "DELETE FROM {JOB_CANCEL_TABLE} WHERE NOT EXISTS (SELECT 1 FROM {JOB_TABLE} j \
         WHERE j.id = {JOB_CANCEL_TABLE}.job_id AND j.state IN ({UNFINISHED}))"
    );
    db.execute_raw(statement(backend, &sql, Vec::new()))
        .await
        .map(|done| done.rows_affected())
}

/// The condition a completion adds: no request to stop the job.
pub(super) fn not_requested() -> String {
    format!(" AND NOT EXISTS (SELECT 1 FROM {JOB_CANCEL_TABLE} c WHERE c.job_id = {JOB_TABLE}.id)")
}
