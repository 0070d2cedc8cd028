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
    let stmt = statement(backend, &insert_sql(backend, 1), rows(db, &[job]).await?);
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

/// Inserts the jobs with one statement, each unless its unique key is taken by a job that has
/// not finished (nor by an earlier one of `jobs`): how many were added.
pub(crate) async fn insert_many(
    db: &impl ConnectionTrait,
    jobs: &[&Insert<'_>],
) -> Result<u64, DbErr> {
    if jobs.is_empty() {
        return Ok(0);
    }
    let backend = db.get_database_backend();
    let stmt = statement(
        backend,
        &insert_sql(backend, jobs.len()),
        rows(db, jobs).await?,
    );
    if backend == DbBackend::MySql {
        return Ok(db.execute_raw(stmt).await?.rows_affected());
    }
    Ok(db.query_all_raw(stmt).await?.len() as u64)
}

/// The `INSERT` of `n` jobs (each row's values from [`rows`]). On PostgreSQL the statement also
/// wakes idle workers (`wake.rs`): `NOTIFY` is transactional, so they hear of the jobs when they
/// commit, and never of a duplicate.
///
/// A keyed job behind an unfinished job of its key is queued, not ready (see `Stored::Queued`):
/// on MySQL the state is a value, known before the statement (MySQL cannot read the table an
/// `INSERT` writes); elsewhere the `INSERT` reads it itself, with **one** subquery over the
/// rows given as a `WITH … AS (VALUES …)` — a subquery per row cost PostgreSQL's planner about
/// 0.1 ms a row (137 ms for 1,000 rows against 40 ms). The rows keep the order given.
fn insert_sql(backend: DbBackend, n: usize) -> String {
    let now = now_ms(backend);
    let columns = "kind, payload, job_key, key_hash, unique_key, unique_hash, priority, run_at, \
                   created_at, state";
    if backend == DbBackend::MySql {
        let row = format!("(?, ?, ?, ?, ?, ?, ?, {now} + ?, {now}, ?)");
        let values = vec![row; n].join(", ");
        return format!("INSERT IGNORE INTO {JOB_TABLE} ({columns}) VALUES {values}");
    }
    let returning = match backend {
        DbBackend::Postgres => format!(
            "id, pg_notify('{}', '') AS woke",
            crate::jobs::wake::CHANNEL
        ),
        _ => "id".to_owned(),
    };
    let values = vec!["(?, ?, ?, ?, ?, ?, ?, ?, ?)"; n].join(", ");
    // `WHERE 1 = 1`: SQLite reads `ON CONFLICT` after a bare `FROM` as a join's. The clock is
    // read once (`t`): PostgreSQL's `clock_timestamp()` moves within a statement, and a job due
    // at once must not show a `created_at` after its `run_at`.
    format!(
        "WITH t (now) AS (SELECT {now}), \
         v (kind, payload, job_key, key_hash, unique_key, unique_hash, priority, delay, \
         behind) AS (VALUES {values}) \
         INSERT INTO {JOB_TABLE} ({columns}) \
         SELECT v.kind, v.payload, v.job_key, v.key_hash, v.unique_key, v.unique_hash, \
         v.priority, t.now + v.delay, t.now, \
         CASE WHEN v.behind = 1 OR EXISTS (SELECT 1 FROM {JOB_TABLE} h \
         WHERE h.key_hash = v.key_hash AND h.state IN ({UNFINISHED})) THEN {Queued} ELSE {Pending} END \
         FROM v, t WHERE 1 = 1 ON CONFLICT DO NOTHING RETURNING {returning}"
    )
}

/// The values of each job's row. A keyed job behind an unfinished job of its key is queued,
/// not ready (see `Stored::Queued`): decided by the `INSERT` itself where the database lets it
/// read the table it inserts into (not MySQL, where one read of the keys comes first) — on
/// SQLite a write from the start: a deferred transaction that read first could not take the
/// write lock once another process wrote (`SQLITE_BUSY_SNAPSHOT`). A job behind an earlier one
/// of its key among `jobs` is queued at once.
async fn rows(db: &impl ConnectionTrait, jobs: &[&Insert<'_>]) -> Result<Vec<Value>, DbErr> {
    let backend = db.get_database_backend();
    let busy = if backend == DbBackend::MySql {
        busy_keys(db, jobs).await?
    } else {
        Vec::new()
    };
    let mut seen = Vec::new();
    let mut values = Vec::with_capacity(jobs.len() * 10);
    for job in jobs {
        let key = job.key.map(hash);
        let behind_earlier = key.as_ref().is_some_and(|k| seen.contains(k));
        let known = behind_earlier || (key.as_ref()).is_some_and(|k| busy.contains(k));
        values.extend([
            bytes(Some(job.kind)),
            job.payload.into(),
            bytes(job.key),
            Value::Bytes(key.clone()),
            bytes(job.unique),
            Value::Bytes(job.unique.map(hash)),
            job.priority.into(),
            millis(job.delay).into(),
        ]);
        if backend == DbBackend::MySql {
            let state = if known { Queued } else { Pending };
            values.push(state.into());
        } else {
            values.push(Value::from(i32::from(known)));
        }
        if let Some(key) = key {
            seen.push(key);
        }
    }
    Ok(values)
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

/// The keys among `jobs`' that have an unfinished job (their hashes): one read, for MySQL.
async fn busy_keys(db: &impl ConnectionTrait, jobs: &[&Insert<'_>]) -> Result<Vec<Vec<u8>>, DbErr> {
    let keys: Vec<Value> = (jobs.iter())
        .filter_map(|job| job.key)
        .map(hashed)
        .collect();
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let backend = db.get_database_backend();
    let sql = format!(
        "SELECT DISTINCT key_hash FROM {JOB_TABLE} WHERE key_hash IN ({}) \
         AND state IN ({UNFINISHED})",
        vec!["?"; keys.len()].join(", ")
    );
    let rows = db.query_all_raw(statement(backend, &sql, keys)).await?;
    rows.iter().map(|row| row.try_get("", "key_hash")).collect()
}
