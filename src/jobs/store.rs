//! The job table's statements, per dialect (the table itself: `schema.rs`).

use std::time::Duration;

use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, QueryResult, Value};
use sha2::{Digest, Sha256};

use super::state::{
    Stored::{Done, Failed, Leased, Pending, Queued},
    UNFINISHED,
};
use crate::{
    db::{
        autocommit::{autocommit, upkeep},
        pool::Pool,
    },
    lock::sql::{for_update, for_update_skip_locked, millis, now_ms, statement},
    schema::JOB_TABLE,
};

/// Most stranded jobs one [`sweep`] readies (the next sweep readies more).
const SWEEP_AT_MOST: u32 = 500;

/// Longest error text kept with a job, in characters.
const MAX_ERROR: usize = 4000;

/// The SHA-256 of a key: what the indexes hold, so that a key of any length is compared byte for
/// byte through a fixed-size index entry.
pub(crate) fn hash(key: impl AsRef<[u8]>) -> Vec<u8> {
    Sha256::digest(key.as_ref()).to_vec()
}

fn bytes(value: Option<&str>) -> Value {
    Value::Bytes(value.map(|v| v.as_bytes().to_vec()))
}

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
            super::wake::CHANNEL
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
                .query_one_raw(statement(
                    backend,
                    &sql,
                    vec![Value::Bytes(Some(hash(key)))],
                ))
                .await?;
            state = if found.is_some() { Queued } else { Pending }.to_string();
        } else {
            state = format!("CASE WHEN {behind} THEN {Queued} ELSE {Pending} END");
            state_values.push(Value::Bytes(Some(hash(key))));
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
        .query_one_raw(statement(
            backend,
            &sql,
            vec![Value::Bytes(Some(hash(unique)))],
        ))
        .await?;
    row.map(|row| row.try_get::<i64>("", "id")).transpose()
}

/// A job taken by [`take`], its row locked by the transaction.
pub(crate) struct Taken {
    pub(crate) id: i64,
    pub(crate) kind: Vec<u8>,
    pub(crate) key: Option<Vec<u8>>,
    pub(crate) payload: String,
    /// Attempts before this one.
    pub(crate) attempts: i32,
    /// Milliseconds since the job was due (database clock).
    pub(crate) waited: i64,
    /// A queued job of its key comes after it (read by a take that may start a chain, else
    /// `false`): a chain may follow it (`take_after`).
    pub(crate) followed: bool,
}

impl Taken {
    /// The job a take's `row` holds (`followed` read by the caller).
    fn read(row: &QueryResult, followed: bool) -> Result<Self, DbErr> {
        Ok(Self {
            id: row.try_get("", "id")?,
            kind: row.try_get("", "kind")?,
            key: row.try_get("", "job_key")?,
            payload: row.try_get("", "payload")?,
            attempts: row.try_get("", "attempts")?,
            waited: row.try_get("", "waited")?,
            followed,
        })
    }
}

/// Locks the next `limit` jobs to run, in `txn`: the first by priority, then enqueue order,
/// among those due whose key has no earlier unfinished job (so never two jobs of one key). Rows other workers locked are skipped
/// (`SKIP LOCKED`; SQLite's `BEGIN IMMEDIATE` already made this the only writer), so a busy
/// key — its head locked by the worker running it — hands out nothing, and a worker is never
/// given a job it would wait for. With `chain`, each job's `followed` is read too.
pub(crate) async fn take(
    txn: &DatabaseTransaction,
    limit: u32,
    chain: bool,
) -> Result<Vec<Taken>, DbErr> {
    // InnoDB locks every row a sort reads: the scan must follow `freshlock_job_next` (MariaDB
    // 10.8+ and MySQL 8 keep its `DESC`), and stop at the first row it can lock.
    let scan = Scan {
        index: "freshlock_job_next",
        filter: "(j.key_hash IS NULL OR {head})",
        order: "j.priority DESC, j.id",
        limit,
        chain,
    };
    lock_due(txn, &scan, Vec::new()).await
}

/// Locks the next job of key `key_hash` (its SHA-256) to run, if it is due and its key's head:
/// the worker that just finished the key's job follows the key with it, so that a hot key's
/// chain never waits for a free worker (`Worker::run`). `chain` as for [`take`].
pub(crate) async fn take_key(
    txn: &DatabaseTransaction,
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
    lock_due(txn, &scan, vec![Value::Bytes(Some(key_hash.to_vec()))]).await
}

/// Locks the jobs of key `key_hash` (its SHA-256) that come right after job `after` — up to
/// `limit`, in id order, each due and queued — for the transaction that holds `after` (the
/// key's head, completed in it) to run them one after another: a chain (`Source::Take`). Only
/// an unbroken run is returned: it ends before the first unfinished job of the key that is not
/// queued and due, or that another transaction locked (skipped, never waited for). Their
/// states are left as they are: the completion that marks them done readies the key's next
/// job after them (`complete`'s exclusion), and one the transaction does not get to stays
/// queued, first in line.
pub(crate) async fn take_after(
    txn: &DatabaseTransaction,
    key_hash: &[u8],
    after: i64,
    limit: u32,
) -> Result<Vec<Taken>, DbErr> {
    let backend = txn.get_database_backend();
    let now = now_ms(backend);
    let skip = for_update_skip_locked(backend);
    // InnoDB locks every row the scan reads: it follows the key's index, in id order.
    let index = if backend == DbBackend::MySql {
        " FORCE INDEX (freshlock_job_key)"
    } else {
        ""
    };
    // `ahead`: the key's unfinished jobs between `after` and this one, whatever their state or
    // lock. The run is unbroken while each row's `ahead` is its place in the run.
    let sql = format!(
        "SELECT j.id, j.kind, j.job_key, j.payload, j.attempts, {now} - j.run_at AS waited, \
         (SELECT COUNT(*) FROM {JOB_TABLE} h WHERE h.key_hash = j.key_hash \
         AND h.state IN ({UNFINISHED}) AND h.id > ? AND h.id < j.id) AS ahead \
         FROM {JOB_TABLE} j{index} \
         WHERE j.key_hash = ? AND j.state = {Queued} AND j.id > ? AND j.run_at <= {now} \
         ORDER BY j.id LIMIT {limit}{skip}"
    );
    let values = vec![
        after.into(),
        Value::Bytes(Some(key_hash.to_vec())),
        after.into(),
    ];
    let rows = txn.query_all_raw(statement(backend, &sql, values)).await?;
    let mut run = Vec::with_capacity(rows.len());
    for row in &rows {
        let ahead: i64 = row.try_get("", "ahead")?;
        if usize::try_from(ahead).ok() != Some(run.len()) {
            break;
        }
        run.push(Taken::read(row, false)?);
    }
    Ok(run)
}

/// How a take finds due jobs: the index it follows (forced on MySQL), its condition besides
/// being due (`{head}` stands for [`head`]), its order, how many, and whether a chain may
/// follow the job it takes (then it reads `Taken::followed`).
struct Scan {
    index: &'static str,
    filter: &'static str,
    order: &'static str,
    limit: u32,
    chain: bool,
}

/// Locks the due jobs `scan` finds (`values` fill its placeholders), skipping locked rows.
async fn lock_due(
    txn: &DatabaseTransaction,
    scan: &Scan,
    values: Vec<Value>,
) -> Result<Vec<Taken>, DbErr> {
    let backend = txn.get_database_backend();
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
    let filter = filter.replace("{head}", &head());
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
         WHERE j.state = {Pending} AND j.run_at <= {now} AND {filter} \
         ORDER BY {order} LIMIT {limit}{skip}"
    );
    let rows = txn.query_all_raw(statement(backend, &sql, values)).await?;
    rows.iter()
        .map(|row| Taken::read(row, *chain && flag(row, "followed")?))
        .collect()
}

/// A truth value of column `column`: a boolean on PostgreSQL, an integer on MySQL and SQLite.
fn flag(row: &QueryResult, column: &str) -> Result<bool, DbErr> {
    match row.try_get::<bool>("", column) {
        Ok(flag) => Ok(flag),
        Err(_) => row.try_get::<i64>("", column).map(|n| n != 0),
    }
}

/// Keyed job `j` is its key's head: no earlier job of its key is unfinished.
fn head() -> String {
    format!(
        "NOT EXISTS (SELECT 1 FROM {JOB_TABLE} h WHERE h.key_hash = j.key_hash \
         AND h.state IN ({UNFINISHED}) AND h.id < j.id)"
    )
}

/// Marks jobs `ids` done, in the transaction that ran them (their attempts counted, their
/// unique keys free, a leased one's claim ended), and makes the first queued job of each key in
/// `promote` ready (see [`promote`]): how many it readied. With `stamps` (PostgreSQL), the
/// statement also returns those expressions — the commit's evidence, taken by this statement
/// rather than one of its own: the first row. On PostgreSQL the promotion rides in the same
/// statement (a `WITH` of its own: the two touch different rows), elsewhere it is one more.
pub(crate) async fn complete(
    txn: &DatabaseTransaction,
    ids: &[i64],
    stamps: Option<&[&str]>,
    promote: Vec<Vec<u8>>,
) -> Result<(Option<QueryResult>, u64), DbErr> {
    let backend = txn.get_database_backend();
    let folds = backend == DbBackend::Postgres && !promote.is_empty();
    let mut readied = 0;
    let mut values: Vec<Value> = Vec::with_capacity(promote.len() + ids.len());
    let mut sql = String::new();
    // The promotion passes over the jobs completed here: a chain's later jobs are still
    // queued as stored (`take_after`).
    if folds {
        sql = format!(
            "WITH promoted AS ({} RETURNING 1) ",
            promotion(promote.len(), ids.len())
        );
        values.extend(promote.into_iter().map(|h| Value::Bytes(Some(h))));
        values.extend(ids.iter().map(|&id| Value::from(id)));
    } else if !promote.is_empty() {
        readied = self::promote(txn, promote, ids).await?;
    }
    let now = now_ms(backend);
    let placeholders = vec!["?"; ids.len()].join(", ");
    // A leased job's attempt was counted by its claim. (MySQL assigns left to right, each
    // assignment seeing the ones before it: `attempts` reads `state` before it changes.)
    sql.push_str(&format!(
        "UPDATE {JOB_TABLE} SET \
         attempts = attempts + CASE WHEN state = {Leased} THEN 0 ELSE 1 END, state = {Done}, \
         finished_at = {now}, owner = NULL, lease_until = NULL, unique_hash = NULL \
         WHERE id IN ({placeholders})"
    ));
    values.extend(ids.iter().map(|&id| Value::from(id)));
    let mut returning: Vec<&str> = stamps.unwrap_or_default().to_vec();
    if folds {
        returning.push("(SELECT COUNT(*) FROM promoted) AS readied");
    }
    if returning.is_empty() {
        txn.execute_raw(statement(backend, &sql, values)).await?;
        return Ok((None, readied));
    }
    sql.push_str(" RETURNING ");
    sql.push_str(&returning.join(", "));
    let rows = txn.query_all_raw(statement(backend, &sql, values)).await?;
    let first = rows.into_iter().next();
    if folds && let Some(row) = &first {
        readied = u64::try_from(row.try_get::<i64>("", "readied")?).unwrap_or(0);
    }
    Ok((first.filter(|_| stamps.is_some()), readied))
}

/// Records a failed attempt of job `id`: due again after `retry`, or failed for good (its error
/// kept, its unique key free) when `retry` is `None`. A leased job's claim ends either way.
pub(crate) async fn failed(
    txn: &DatabaseTransaction,
    id: i64,
    attempts: i32,
    error: &str,
    retry: Option<Duration>,
) -> Result<(), DbErr> {
    let backend = txn.get_database_backend();
    let now = now_ms(backend);
    // PostgreSQL's text cannot hold NUL.
    let error: String = error
        .chars()
        .take(MAX_ERROR)
        .map(|c| if c == '\0' { '\u{fffd}' } else { c })
        .collect();
    let (sql, values) = match retry {
        Some(delay) => (
            format!(
                "UPDATE {JOB_TABLE} SET state = {Pending}, owner = NULL, lease_until = NULL, \
                 attempts = ?, last_error = ?, run_at = {now} + ? WHERE id = ?"
            ),
            vec![
                attempts.into(),
                error.into(),
                millis(delay).into(),
                id.into(),
            ],
        ),
        None => (
            format!(
                "UPDATE {JOB_TABLE} SET state = {Failed}, owner = NULL, lease_until = NULL, \
                 attempts = ?, last_error = ?, finished_at = {now}, unique_hash = NULL WHERE id = ?"
            ),
            vec![attempts.into(), error.into(), id.into()],
        ),
    };
    txn.execute_raw(statement(backend, &sql, values))
        .await
        .map(drop)
}

/// Makes the first queued job of each key in `key_hashes` ready (their heads finished in
/// `txn`), passing over jobs `except` (finishing in `txn` too): how many.
pub(crate) async fn promote(
    txn: &impl ConnectionTrait,
    key_hashes: Vec<Vec<u8>>,
    except: &[i64],
) -> Result<u64, DbErr> {
    if key_hashes.is_empty() {
        return Ok(0);
    }
    let backend = txn.get_database_backend();
    let sql = promotion(key_hashes.len(), except.len());
    let mut values: Vec<Value> = key_hashes
        .into_iter()
        .map(|h| Value::Bytes(Some(h)))
        .collect();
    values.extend(except.iter().map(|&id| Value::from(id)));
    txn.execute_raw(statement(backend, &sql, values))
        .await
        .map(|done| done.rows_affected())
}

/// The statement of [`promote`] for `keys` key hashes and `except` job ids (its
/// placeholders, in that order).
fn promotion(keys: usize, except: usize) -> String {
    let placeholders = vec!["?"; keys].join(", ");
    let except = match except {
        0 => String::new(),
        n => format!(" AND id NOT IN ({})", vec!["?"; n].join(", ")),
    };
    // The derived table lets MySQL read the table it updates.
    format!(
        "UPDATE {JOB_TABLE} SET state = {Pending} WHERE id IN (SELECT id FROM (\
         SELECT MIN(id) AS id FROM {JOB_TABLE} WHERE state = {Queued} \
         AND key_hash IN ({placeholders}){except} GROUP BY key_hash) heads)"
    )
}

/// Makes ready every queued job with no unfinished job before it in its key: one whose head
/// finished while its own enqueue had not committed yet, so the promotion did not see it.
/// Returns how many.
///
/// Two statements, each locking nothing it does not change: a read of the stranded jobs (a
/// snapshot, no locks), then an `UPDATE` of those rows by id. One `UPDATE` that found them itself
/// would lock every row it read on MySQL/MariaDB (169 rows at READ COMMITTED, the whole table at
/// REPEATABLE READ) and hold them while it waited for the rows of running jobs: every take
/// meanwhile skipped them (`SKIP LOCKED`) and found nothing, every completion waited, and workers
/// that ran until idle stopped with a hot key's jobs left (CI's MariaDB demo). A job the read
/// saw stranded that is not by the time of the `UPDATE` is harmless: `QUEUED` is a hint, and a
/// take still checks that it is its key's head.
pub(crate) async fn sweep(db: &Pool) -> Result<u64, DbErr> {
    let backend = db.get_database_backend();
    let db = autocommit(db);
    // Only the first queued job of a key can be stranded.
    let find = format!(
        "SELECT q.id FROM (SELECT MIN(id) AS id, key_hash FROM {JOB_TABLE} \
         WHERE state = {Queued} GROUP BY key_hash) q WHERE NOT EXISTS (\
         SELECT 1 FROM {JOB_TABLE} h WHERE h.key_hash = q.key_hash \
         AND h.state IN ({UNFINISHED}) AND h.id < q.id) LIMIT {SWEEP_AT_MOST}"
    );
    let rows = db
        .query_all_raw(statement(backend, &find, Vec::new()))
        .await?;
    let ids = (rows.iter())
        .map(|row| row.try_get::<i64>("", "id").map(Value::from))
        .collect::<Result<Vec<_>, _>>()?;
    if ids.is_empty() {
        return Ok(0);
    }
    let placeholders = vec!["?"; ids.len()].join(", ");
    // By primary key on MySQL too (a small table is scanned whole, even for `id IN (…)`).
    let index = if backend == DbBackend::MySql {
        " FORCE INDEX (PRIMARY)"
    } else {
        ""
    };
    let ready = format!(
        "UPDATE {JOB_TABLE}{index} SET state = {Pending} \
         WHERE state = {Queued} AND id IN ({placeholders})"
    );
    upkeep(db.0, statement(backend, &ready, ids)).await
}

/// Claims job `id` (locked by `txn`'s take) for attempt `attempts` under a lease of `lease`
/// held by `owner`: once `txn` commits, the job works outside any transaction and its key stays
/// busy until the claim ends ([`hold`], [`complete`], [`failed`]) or expires ([`reclaim`]).
pub(crate) async fn claim(
    txn: &DatabaseTransaction,
    id: i64,
    attempts: i32,
    owner: &str,
    lease: Duration,
) -> Result<(), DbErr> {
    let backend = txn.get_database_backend();
    let now = now_ms(backend);
    let sql = format!(
        "UPDATE {JOB_TABLE} SET state = {Leased}, owner = ?, lease_until = {now} + ?, \
         attempts = ? WHERE id = ?"
    );
    let values = vec![
        owner.into(),
        millis(lease).into(),
        attempts.into(),
        id.into(),
    ];
    txn.execute_raw(statement(backend, &sql, values))
        .await
        .map(drop)
}

/// Locks job `id` in `txn` if `owner`'s claim on it still holds (the fence of a leased job's
/// finish): `false` when its lease expired and was reclaimed, whether or not another worker
/// took it since. An expired lease that nobody reclaimed yet still holds: the row's lock keeps
/// [`reclaim`] out until `txn` ends.
pub(crate) async fn hold(txn: &DatabaseTransaction, id: i64, owner: &str) -> Result<bool, DbErr> {
    let backend = txn.get_database_backend();
    let lock = for_update(backend);
    let sql =
        format!("SELECT id FROM {JOB_TABLE} WHERE id = ? AND state = {Leased} AND owner = ?{lock}");
    let row = txn
        .query_one_raw(statement(backend, &sql, vec![id.into(), owner.into()]))
        .await?;
    Ok(row.is_some())
}

/// Extends `owner`'s lease on job `id` to `lease` from now (a heartbeat): `false` when the
/// claim no longer holds.
pub(crate) async fn extend(
    db: &impl ConnectionTrait,
    id: i64,
    owner: &str,
    lease: Duration,
) -> Result<bool, DbErr> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    // The expiry moves by a third of the lease between beats, so the row always changes (MySQL
    // counts changed rows only).
    let sql = format!(
        "UPDATE {JOB_TABLE} SET lease_until = {now} + ? \
         WHERE id = ? AND state = {Leased} AND owner = ?"
    );
    let values = vec![millis(lease).into(), id.into(), owner.into()];
    let done = db.execute_raw(statement(backend, &sql, values)).await?;
    Ok(done.rows_affected() == 1)
}

/// Makes every leased job whose lease expired wait again, due now (its worker stopped, hung or
/// lost the database; a late finish is refused by [`hold`]). Returns how many.
pub(crate) async fn reclaim(db: &Pool) -> Result<u64, DbErr> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let sql = format!(
        "UPDATE {JOB_TABLE} SET state = {Pending}, owner = NULL, lease_until = NULL, \
         run_at = {now}, last_error = ? WHERE state = {Leased} AND lease_until < {now}"
    );
    let why = "the lease expired before the job finished (its worker stopped, hung or lost the \
               database)";
    upkeep(db, statement(backend, &sql, vec![why.into()])).await
}
