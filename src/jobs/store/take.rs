//! The take: due jobs locked by one statement (`FOR UPDATE SKIP LOCKED`), each the head of
//! its key; a key followed by its next jobs.

use sea_orm::{ConnectionTrait, DbBackend, DbErr, FromQueryResult, QueryResult, Statement, Value};

use crate::jobs::state::{
    Stored::{Pending, Queued},
    UNFINISHED,
};
use crate::{
    lock::sql::{for_update_skip_locked, now_ms, statement},
    schema::JOB_TABLE,
};

/// A job taken by [`take`], its row locked by the transaction.
#[derive(FromQueryResult)]
pub(crate) struct Taken {
    pub(crate) id: i64,
    pub(crate) kind: Vec<u8>,
    #[sea_orm(from_alias = "job_key")]
    pub(crate) key: Option<Vec<u8>>,
    pub(crate) payload: String,
    /// Attempts before this one.
    pub(crate) attempts: i32,
    /// Milliseconds since the job was due (database clock).
    pub(crate) waited: i64,
    /// A queued job of its key comes after it (read by a take that may start a chain, else
    /// `false`): a chain may follow it (`take_after`).
    #[sea_orm(skip)]
    pub(crate) followed: bool,
}

impl Taken {
    /// The job a take's `row` holds (`followed` read by the caller).
    fn read(row: &QueryResult, followed: bool) -> Result<Self, DbErr> {
        let taken = Self::from_query_result(row, "")?;
        Ok(Self { followed, ..taken })
    }
}

/// Locks the next `limit` jobs to run, in `txn`: the first by priority, then enqueue order,
/// among those of `kinds` (the worker's) due whose key has no earlier unfinished job (so never
/// two jobs of one key). Rows other workers locked are skipped
/// (`SKIP LOCKED`; SQLite's `BEGIN IMMEDIATE` already made this the only writer), so a busy
/// key — its head locked by the worker running it — hands out nothing, and a worker is never
/// given a job it would wait for. With `chain`, each job's `followed` is read too. Jobs of the
/// keys hashed in `skip_keys` are passed over (over a limit of their key: `jobs/limit.rs`).
pub(crate) async fn take(
    txn: &impl ConnectionTrait,
    kinds: &[Vec<u8>],
    limit: u32,
    chain: bool,
    skip_keys: &[Vec<u8>],
) -> Result<Vec<Taken>, DbErr> {
    lock_due(txn, &next(limit, chain), kinds, Vec::new(), skip_keys).await
}

/// [`take`]'s statement (passing over no key), not sent: a held attempt sends it ahead, after
/// its `COMMIT` (`jobs/flights/pretake.rs`), and the next attempt's take, which sends the same
/// text, reads its rows from there. `None` for a worker with no kinds (its take sends nothing).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn take_statement(
    backend: DbBackend,
    kinds: &[Vec<u8>],
    limit: u32,
    chain: bool,
) -> Option<Statement> {
    due_statement(backend, &next(limit, chain), kinds, Vec::new(), &[])
}

/// The scan of [`take`]: InnoDB locks every row a sort reads, so it must follow
/// `freshlock_job_next` (MariaDB 10.8+ and MySQL 8 keep its `DESC`), and stop at the first row
/// it can lock.
fn next(limit: u32, chain: bool) -> Scan {
    Scan {
        index: "freshlock_job_next",
        filter: "(j.key_hash IS NULL OR {head})",
        order: "j.priority DESC, j.id",
        limit,
        chain,
    }
}

/// Locks the next job of key `key_hash` (its SHA-256) to run, if it is due and its key's head:
/// the worker that just finished the key's job follows the key with it, so that a hot key's
/// chain never waits for a free worker (`Worker::run`). `kinds` and `chain` as for [`take`].
pub(crate) async fn take_key(
    txn: &impl ConnectionTrait,
    kinds: &[Vec<u8>],
    key_hash: &[u8],
    chain: bool,
) -> Result<Vec<Taken>, DbErr> {
    let scan = Scan {
        index: "freshlock_job_key",
        filter: "j.key_hash = ? AND {head}",
        order: "j.id",
        limit: 1,
        chain,
    };
    let values = vec![Value::Bytes(Some(key_hash.to_vec()))];
    lock_due(txn, &scan, kinds, values, &[]).await
}

/// Locks the jobs of key `key_hash` (its SHA-256) that come right after job `after` — up to
/// `limit`, in id order, each due and queued — for the transaction that holds `after` (the
/// key's head, completed in it) to run them one after another: a chain (`Source::Take`). Only
/// an unbroken run is returned: it ends before the first unfinished job of the key that is not
/// queued and due, not of `kinds`, or that another transaction locked (skipped, never waited
/// for) — two statements: the scan that locks, then a plain read of the key's unfinished jobs
/// up to the last row it locked. Their states are left as they are: the completion that marks
/// them done readies the key's next job after them (`complete`'s exclusion), and one the
/// transaction does not get to stays queued, first in line (locked until the commit, as a row
/// locked after a break in the run).
pub(crate) async fn take_after(
    txn: &impl ConnectionTrait,
    kinds: &[Vec<u8>],
    key_hash: &[u8],
    after: i64,
    limit: u32,
) -> Result<Vec<Taken>, DbErr> {
    if kinds.is_empty() {
        return Ok(Vec::new());
    }
    let backend = txn.get_database_backend();
    let now = now_ms(backend);
    let skip = for_update_skip_locked(backend);
    let of_kinds = of_kinds(kinds);
    // InnoDB locks every row the scan reads: it follows the key's index, in id order.
    let index = if backend == DbBackend::MySql {
        " FORCE INDEX (freshlock_job_key)"
    } else {
        ""
    };
    let sql = format!(
        "SELECT j.id, j.kind, j.job_key, j.payload, j.attempts, {now} - j.run_at AS waited \
         FROM {JOB_TABLE} j{index} \
         WHERE j.key_hash = ? AND j.state = {Queued} AND j.id > ? AND j.run_at <= {now} \
         AND {of_kinds} ORDER BY j.id LIMIT {limit}{skip}"
    );
    let mut values = vec![Value::Bytes(Some(key_hash.to_vec())), after.into()];
    values.extend(kinds.iter().map(|kind| Value::Bytes(Some(kind.clone()))));
    let rows = txn.query_all_raw(statement(backend, &sql, values)).await?;
    let Some(last) = rows.last() else {
        return Ok(Vec::new());
    };
    let last: i64 = last.try_get("", "id")?;
    // The run is unbroken while the key's unfinished jobs from `after` on, whatever their state
    // or lock (a plain read), are the locked rows, one for one. A read of its own, by constant
    // bounds: as a subquery of the scan above counting them for each row, MariaDB scanned every
    // queued job of the key after `after` for every row (2.2 ms for 15 rows of a hot key with a
    // thousand waiting, against 0.2 ms for the scan alone).
    let unfinished = format!(
        "SELECT id FROM {JOB_TABLE}{index} WHERE key_hash = ? AND state IN ({UNFINISHED}) \
         AND id > ? AND id <= ? ORDER BY id"
    );
    let values = vec![
        Value::Bytes(Some(key_hash.to_vec())),
        after.into(),
        last.into(),
    ];
    let ids = txn
        .query_all_raw(statement(backend, &unfinished, values))
        .await?;
    let mut run = Vec::with_capacity(rows.len());
    for (row, unfinished) in rows.iter().zip(&ids) {
        let taken = Taken::read(row, false)?;
        if unfinished.try_get::<i64>("", "id")? != taken.id {
            break;
        }
        run.push(taken);
    }
    Ok(run)
}

/// How a take finds due jobs: the index it follows (forced on MySQL), its condition besides
/// being due (`{head}` stands for [`super::head::is_head`] of `j`), its order, how many, and
/// whether a chain may follow the job it takes (then it reads `Taken::followed`).
struct Scan {
    index: &'static str,
    filter: &'static str,
    order: &'static str,
    limit: u32,
    chain: bool,
}

/// Locks the due jobs of `kinds` that `scan` finds (`values` fill its placeholders), skipping
/// locked rows and the keys hashed in `skip_keys`. A worker with no kinds takes nothing.
async fn lock_due(
    txn: &impl ConnectionTrait,
    scan: &Scan,
    kinds: &[Vec<u8>],
    values: Vec<Value>,
    skip_keys: &[Vec<u8>],
) -> Result<Vec<Taken>, DbErr> {
    let backend = txn.get_database_backend();
    let Some(statement) = due_statement(backend, scan, kinds, values, skip_keys) else {
        return Ok(Vec::new());
    };
    let rows = txn.query_all_raw(statement).await?;
    rows.iter()
        .map(|row| Taken::read(row, scan.chain && flag(row, "followed")?))
        .collect()
}

/// [`lock_due`]'s statement; `None` when `kinds` is empty.
fn due_statement(
    backend: DbBackend,
    scan: &Scan,
    kinds: &[Vec<u8>],
    mut values: Vec<Value>,
    skip_keys: &[Vec<u8>],
) -> Option<Statement> {
    if kinds.is_empty() {
        return None;
    }
    values.extend(kinds.iter().map(|kind| Value::Bytes(Some(kind.clone()))));
    let mut of_kinds = of_kinds(kinds);
    if !skip_keys.is_empty() {
        let marks = vec!["?"; skip_keys.len()].join(", ");
        of_kinds.push_str(&format!(
            " AND (j.key_hash IS NULL OR j.key_hash NOT IN ({marks}))"
        ));
        values.extend(skip_keys.iter().map(|key| Value::Bytes(Some(key.clone()))));
    }
    let now = now_ms(backend);
    let skip = for_update_skip_locked(backend);
    let index = if backend == DbBackend::MySql {
        format!(" FORCE INDEX ({})", scan.index)
    } else {
        String::new()
    };
    let Scan {
        filter,
        order,
        limit,
        chain,
        ..
    } = scan;
    let filter = filter.replace("{head}", &super::head::is_head(backend, "j"));
    // Whether a chain may follow the job (`Taken::followed`): asked only by a take that may
    // start one, so no other take pays for the probe.
    let followed = if *chain {
        format!(
            ", EXISTS (SELECT 1 FROM {JOB_TABLE} q WHERE q.key_hash = j.key_hash \
             AND q.state = {Queued} AND q.id > j.id) AS followed"
        )
    } else {
        String::new()
    };
    let sql = format!(
        "SELECT j.id, j.kind, j.job_key, j.payload, j.attempts, {now} - j.run_at AS waited\
         {followed} FROM {JOB_TABLE} j{index} \
         WHERE j.state = {Pending} AND j.run_at <= {now} AND {filter} AND {of_kinds} \
         ORDER BY {order} LIMIT {limit}{skip}"
    );
    Some(statement(backend, &sql, values))
}

/// A truth value of column `column`: a boolean on PostgreSQL, an integer on MySQL and SQLite.
fn flag(row: &QueryResult, column: &str) -> Result<bool, DbErr> {
    match row.try_get::<bool>("", column) {
        Ok(flag) => Ok(flag),
        Err(_) => row.try_get::<i64>("", column).map(|n| n != 0),
    }
}

/// Job `j` is of one of `kinds` (one placeholder each): a worker takes only the kinds it has
/// handlers for, so services and versions with different kinds share the table, and a kind no
/// worker handles waits.
fn of_kinds(kinds: &[Vec<u8>]) -> String {
    let marks = vec!["?"; kinds.len()].join(", ");
    format!("j.kind IN ({marks})")
}
