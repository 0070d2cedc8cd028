//! Enqueueing: a job's row, unless its unique key is taken by a job that has not finished.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Value};

use crate::jobs::state::{
    Stored::{Pending, Queued},
    UNFINISHED,
};
use crate::{
    lock::sql::{millis, now_ms, statement},
    schema::JOB_TABLE,
};

use super::{bytes, hash, hashed};

/// What [`insert`] stores.
pub(crate) struct Insert<'a> {
    pub(crate) kind: &'a str,
    pub(crate) payload: &'a str,
    pub(crate) key: Option<&'a str>,
    pub(crate) unique: Option<&'a str>,
    pub(crate) priority: i32,
    pub(crate) delay: Duration,
}

/// Inserts the job unless its unique key is taken by a job that has not finished: its id, or
/// `None` for a duplicate. Never fails on the duplicate itself, so the caller's transaction
/// goes on (`ON CONFLICT DO NOTHING`; MySQL's `INSERT IGNORE`, harmless here: every column
/// takes any value of its Rust type, so nothing else can be ignored).
pub(crate) async fn insert(
    db: &impl ConnectionTrait,
    job: &Insert<'_>,
) -> Result<Option<i64>, DbErr> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    // On PostgreSQL the statement also wakes idle workers (`wake.rs`): `NOTIFY` is
    // transactional, so they hear of the job when it commits, and never of a duplicate.
    let tail = match backend {
        DbBackend::Postgres => format!(
            " ON CONFLICT DO NOTHING RETURNING id, pg_notify('{}', '') AS woke",
            crate::jobs::wake::CHANNEL
        ),
        _ => " ON CONFLICT DO NOTHING RETURNING id".to_owned(),
    };
    let verb = match backend {
        DbBackend::MySql => "INSERT IGNORE",
        _ => "INSERT",
    };
    let tail = if backend == DbBackend::MySql {
        ""
    } else {
        &tail
    };
    // Behind an unfinished job of its key: queued, not ready (see `Stored::Queued`). Decided by the
    // INSERT itself where the database lets it read the table it inserts into (not MySQL): one
    // statement, and on SQLite a write from the start — a deferred transaction that read first
    // could not take the write lock once another process wrote (`SQLITE_BUSY_SNAPSHOT`).
    let behind = format!(
        "EXISTS (SELECT 1 FROM {JOB_TABLE} WHERE key_hash = ? AND state IN ({UNFINISHED}))"
    );
    let mut state = Pending.to_string();
    let mut state_values = Vec::new();
    if let Some(key) = job.key {
        if backend == DbBackend::MySql {
            let sql = format!(
                "SELECT 1 AS one FROM {JOB_TABLE} WHERE key_hash = ? AND state IN ({UNFINISHED}) \
                 LIMIT 1"
            );
            let found = db
                .query_one_raw(statement(backend, &sql, vec![hashed(key)]))
                .await?;
            state = if found.is_some() { Queued } else { Pending }.to_string();
        } else {
            state = format!("CASE WHEN {behind} THEN {Queued} ELSE {Pending} END");
            state_values.push(hashed(key));
        }
    }
    let sql = format!(
        "{verb} INTO {JOB_TABLE} (kind, payload, job_key, key_hash, unique_key, unique_hash, \
         priority, run_at, created_at, state) \
         VALUES (?, ?, ?, ?, ?, ?, ?, {now} + ?, {now}, {state}){tail}"
    );
    let mut values = vec![
        bytes(Some(job.kind)),
        job.payload.into(),
        bytes(job.key),
        Value::Bytes(job.key.map(hash)),
        bytes(job.unique),
        Value::Bytes(job.unique.map(hash)),
        job.priority.into(),
        millis(job.delay).into(),
    ];
    values.extend(state_values);
    let stmt = statement(backend, &sql, values);
    if backend == DbBackend::MySql {
        let done = db.execute_raw(stmt).await?;
        return Ok((done.rows_affected() == 1)
            .then(|| i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX)));
    }
    match db.query_one_raw(stmt).await? {
        Some(row) => row.try_get::<i64>("", "id").map(Some),
        None => Ok(None),
    }
}

/// The id of the unfinished job that holds unique key `unique`, if any.
pub(crate) async fn holder_of(
    db: &impl ConnectionTrait,
    unique: &str,
) -> Result<Option<i64>, DbErr> {
    let backend = db.get_database_backend();
    let sql = format!("SELECT id FROM {JOB_TABLE} WHERE unique_hash = ?");
    let row = db
        .query_one_raw(statement(backend, &sql, vec![hashed(unique)]))
        .await?;
    row.map(|row| row.try_get::<i64>("", "id")).transpose()
}
