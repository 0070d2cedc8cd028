//! What an operator does with the queue (`freshlock jobs`): its depth per kind and key, the
//! jobs in a state, retrying or discarding one, and pruning finished ones.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, DbErr, QueryResult, Value};

use super::{JobId, state::Stored, store};
use crate::{
    database::Db,
    db::{
        autocommit::{autocommit, upkeep},
        deadline::DEFAULT_REPLY,
        own::{Own, rollback},
    },
    error::{Result, database},
    lock::sql::{millis, now_ms, statement},
    schema::JOB_TABLE,
};

/// A job's state as stored.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum JobState {
    /// Waiting to run (also while it runs in a worker's transaction, its row locked there, and
    /// while it waits for a retry).
    Waiting,
    /// Claimed by a worker under a lease, its work running outside any transaction
    /// ([`Jobs::handle_leased`](super::Jobs::handle_leased)); it waits again if the lease
    /// expires.
    Leased,
    /// Completed: its handler's writes committed with it.
    Done,
    /// Failed for good, its error kept ([`retry`] makes it wait again).
    Failed,
    /// Discarded by an operator before it ran ([`discard`]).
    Discarded,
}

impl JobState {
    fn stored(self) -> Stored {
        match self {
            Self::Waiting => Stored::Pending,
            Self::Leased => Stored::Leased,
            Self::Done => Stored::Done,
            Self::Failed => Stored::Failed,
            Self::Discarded => Stored::Discarded,
        }
    }

    fn from_stored(code: i16) -> Option<Self> {
        Some(match Stored::from_code(code)? {
            Stored::Pending | Stored::Queued => Self::Waiting,
            Stored::Leased => Self::Leased,
            Stored::Done => Self::Done,
            Stored::Failed => Self::Failed,
            Stored::Discarded => Self::Discarded,
        })
    }

    /// The state's name: `waiting`, `leased`, `done`, `failed`, `discarded`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Leased => "leased",
            Self::Done => "done",
            Self::Failed => "failed",
            Self::Discarded => "discarded",
        }
    }
}

/// The queue's depth for one kind and key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Depth {
    /// The jobs' kind.
    pub kind: String,
    /// Their serialization key (`None`: jobs without one).
    pub key: Option<String>,
    /// Jobs waiting to run (due or not, running included, leased ones too).
    pub waiting: u64,
    /// Of those, the ones that can run now: due, and not behind an earlier job of their key.
    pub due: u64,
    /// Jobs failed for good.
    pub failed: u64,
}

/// One job, as [`list`] shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobInfo {
    /// The job's id.
    pub id: JobId,
    /// Its kind.
    pub kind: String,
    /// Its serialization key.
    pub key: Option<String>,
    /// Its unique key.
    pub unique: Option<String>,
    /// Its state.
    pub state: JobState,
    /// Attempts made.
    pub attempts: i32,
    /// Its priority.
    pub priority: i32,
    /// When it is (or was) due, in milliseconds since the Unix epoch (database clock).
    pub run_at_ms: i64,
    /// The error of its last failed attempt.
    pub last_error: Option<String>,
}

fn text(bytes: Option<Vec<u8>>) -> Option<String> {
    bytes.map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn count(row: &QueryResult, column: &str) -> std::result::Result<u64, DbErr> {
    let n: Option<i64> = row.try_get("", column)?;
    Ok(u64::try_from(n.unwrap_or(0)).unwrap_or(0))
}

/// The depth of the queue per kind and key: jobs waiting (and due) and failed, by kind, then
/// by key. Kinds and keys are told apart byte for byte, at any length.
///
/// # Errors
/// [`crate::Error::Database`] when the query fails.
pub async fn depth(db: impl Into<Db>) -> Result<Vec<Depth>> {
    // One statement of its own (in a transaction behind a transaction pooler).
    let db = db.into();
    let pool = db.pool();
    let db = &autocommit(pool);
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let bigint = if backend == DbBackend::MySql {
        "SIGNED"
    } else {
        "BIGINT"
    };
    let (pending, queued, failed) = (Stored::Pending, Stored::Queued, Stored::Failed);
    let leased = Stored::Leased;
    let sum =
        |condition: &str| format!("CAST(SUM(CASE WHEN {condition} THEN 1 ELSE 0 END) AS {bigint})");
    // MySQL/MariaDB group and sort a long binary value by its first `max_sort_length` bytes
    // (1,024) only: the kind's SHA-256 keeps two kinds that share those apart, and next to
    // their own rows in the order (`record_depth` sums adjacent rows). Keys go by `key_hash`.
    let kind = if backend == DbBackend::MySql {
        "kind, SHA2(kind, 256)"
    } else {
        "kind"
    };
    let sql = format!(
        "SELECT kind, job_key, {waiting} AS waiting, {due} AS due, {failed_n} AS failed \
         FROM {JOB_TABLE} WHERE state IN ({pending}, {leased}, {queued}, {failed}) \
         GROUP BY {kind}, key_hash, job_key ORDER BY {kind}, key_hash",
        waiting = sum(&format!("state IN ({pending}, {leased}, {queued})")),
        due = sum(&format!("state = {pending} AND run_at <= {now}")),
        failed_n = sum(&format!("state = {failed}")),
    );
    let fail = |e| database("reading the depth of", &JOB_TABLE, e);
    let rows = db
        .query_all_raw(statement(backend, &sql, Vec::new()))
        .await
        .map_err(fail)?;
    rows.iter()
        .map(|row| {
            Ok(Depth {
                kind: text(row.try_get("", "kind")?).unwrap_or_default(),
                key: text(row.try_get("", "job_key")?),
                waiting: count(row, "waiting")?,
                due: count(row, "due")?,
                failed: count(row, "failed")?,
            })
        })
        .collect::<std::result::Result<_, DbErr>>()
        .map_err(fail)
}

/// Reads the queue's [`depth`] and sets the `freshlock_job_depth` gauge per kind and state
/// (`waiting`, `due`, `failed`; summed over keys; a kind no longer in the queue goes to 0) —
/// with the `metrics` feature; without it, this only reads. [`Worker::run`](super::Worker::run)
/// calls it every 10 s (one of a worker's clones), so a service that runs workers need not.
///
/// # Errors
/// As [`depth`].
pub async fn record_depth(db: impl Into<Db>) -> Result<Vec<Depth>> {
    let depths = depth(db).await?;
    let mut per_kind: Vec<(String, u64, u64, u64)> = Vec::new();
    for d in &depths {
        match per_kind.last_mut() {
            // `depth` is ordered by kind.
            Some(last) if last.0 == d.kind => {
                last.1 += d.waiting;
                last.2 += d.due;
                last.3 += d.failed;
            }
            _ => per_kind.push((d.kind.clone(), d.waiting, d.due, d.failed)),
        }
    }
    crate::metrics::job_depth(&per_kind);
    Ok(depths)
}

/// Up to `limit` jobs in `state`, oldest first.
///
/// # Errors
/// [`crate::Error::Database`] when the query fails.
pub async fn list(db: impl Into<Db>, state: JobState, limit: u64) -> Result<Vec<JobInfo>> {
    let db = db.into();
    let pool = db.pool();
    let db = &autocommit(pool);
    let backend = db.get_database_backend();
    let sql = format!(
        "SELECT id, kind, job_key, unique_key, state, attempts, priority, run_at, last_error \
         FROM {JOB_TABLE} WHERE state IN (?, ?) ORDER BY id LIMIT ?"
    );
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    // A waiting job may be queued behind another of its key.
    let also = if state == JobState::Waiting {
        Stored::Queued
    } else {
        state.stored()
    };
    let values = vec![state.stored().into(), also.into(), limit.into()];
    let fail = |e| database("listing", &JOB_TABLE, e);
    let rows = db
        .query_all_raw(statement(backend, &sql, values))
        .await
        .map_err(fail)?;
    rows.iter()
        .map(|row| {
            let stored: i16 = row.try_get("", "state")?;
            Ok(JobInfo {
                id: row.try_get("", "id")?,
                kind: text(row.try_get("", "kind")?).unwrap_or_default(),
                key: text(row.try_get("", "job_key")?),
                unique: text(row.try_get("", "unique_key")?),
                state: JobState::from_stored(stored).unwrap_or(state),
                attempts: row.try_get("", "attempts")?,
                priority: row.try_get("", "priority")?,
                run_at_ms: row.try_get("", "run_at")?,
                last_error: row.try_get("", "last_error")?,
            })
        })
        .collect::<std::result::Result<_, DbErr>>()
        .map_err(fail)
}

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

/// Makes failed job `id` wait again, due now, its attempts counted from zero (its last error
/// is kept until it runs). Its unique key is taken back, unless another unfinished job holds it.
///
/// # Errors
/// [`crate::Error::Database`] when the database fails.
pub async fn retry(db: impl Into<Db>, id: JobId) -> Result<Retried> {
    let db = db.into();
    let own = Own::new(db.pool(), DEFAULT_REPLY);
    let fail = |e| database("retrying a job of", &JOB_TABLE, e);
    let (txn, retried) = (own.open(|txn| Box::pin(retry_in(txn, id))).await).map_err(fail)?;
    match retried {
        Retried::Waiting => own.commit(txn).await.map_err(fail)?,
        _ => rollback(txn, own.reply()).await,
    }
    Ok(retried)
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
    let db = db.into();
    let own = Own::new(db.pool(), DEFAULT_REPLY);
    let fail = |e| database("discarding a job of", &JOB_TABLE, e);
    let (txn, discarded) = (own.open(|txn| Box::pin(discard_in(txn, id))).await).map_err(fail)?;
    if discarded {
        own.commit(txn).await.map_err(fail)?;
    } else {
        rollback(txn, own.reply()).await;
    }
    Ok(discarded)
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
    /// Done and discarded jobs; failed ones keep their error for [`list`] and can be
    /// [`retry`]-ed.
    Finished,
    /// Done, discarded and failed jobs.
    FinishedAndFailed,
}

/// Deletes the jobs that finished `older_than` ago or earlier (database clock; `Duration::ZERO`:
/// every finished job), as `which` says. Returns how many it deleted.
///
/// Finished jobs stay in the table until pruned (README, *Keyed jobs*). Waiting and leased jobs
/// are never touched, and neither a key's order nor a unique key depends on finished jobs, so a
/// prune may run while workers do: it locks only the jobs it deletes. It deletes in batches of
/// 1,000, each a read of the batch and a `DELETE` of its rows, statements of their own (each in a
/// transaction of its own behind a transaction pooler); a prune that fails part-way keeps what
/// its earlier batches deleted.
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
    let mut states = vec![Stored::Done, Stored::Discarded];
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
