//! A finished key's next job readied — and, for a leased job's finish in a worker's loop,
//! claimed by the same statement ([`Claiming`]).

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, DbErr, FromQueryResult, QueryResult, Value};

use super::Taken;
use crate::jobs::state::Stored::{Leased, Pending, Queued};
use crate::{
    lock::sql::{millis, now_ms, statement},
    schema::JOB_TABLE,
};

/// A promotion that claims the job it readies when that job could be claimed by a take of the
/// finishing worker: of a leased kind it runs (without limits, which a take of its own admits),
/// due, with attempts left. The job is then `LEASED` by `owner` for its kind's lease, its attempt
/// counted, as [`super::claim`] leaves a job it claims; otherwise it is readied as usual.
///
/// Why in the promotion: a hot key's leased jobs each end in a finish whose transaction then
/// readied the next job, locked it again with a take and claimed it with an UPDATE of its own —
/// three statements on one row. On PostgreSQL the promotion rides in the completion's statement
/// and claims in its `SET` ([`Claiming::set`]), the claimed row coming back in the completion's
/// own reply (see [`super::complete`]): none of the three is left. On MySQL/MariaDB the
/// promotion follows the completion in its message, with the same `SET` ([`Chained`]). Elsewhere
/// (SQLite, and a finish that only records a failure) the read that finds the key's next job
/// says whether it can be claimed, and one `UPDATE` claims or readies it ([`read_then_ready`]).
pub(crate) struct Claiming<'a> {
    /// The claim's owner token.
    pub(crate) owner: &'a str,
    /// The kinds it may claim.
    pub(crate) kinds: &'a [Claimable],
}

/// A kind a [`Claiming`] promotion may claim a job of.
pub(crate) struct Claimable {
    pub(crate) kind: Vec<u8>,
    /// The attempts its retry policy allows.
    pub(crate) attempts: u32,
    /// Its lease.
    pub(crate) lease: Duration,
}

impl Claiming<'_> {
    /// The `SET` of a promotion in one statement (PostgreSQL's, in the completion) and its
    /// values: `LEASED` by the owner where the job can be claimed, else readied.
    fn set(&self, backend: DbBackend) -> (String, Vec<Value>) {
        let now = now_ms(backend);
        let arms = "WHEN ? THEN ? ".repeat(self.kinds.len());
        let claimable = format!("(run_at <= {now} AND attempts < CASE kind {arms}ELSE 0 END)");
        let allowed: Vec<Value> = (self.kinds.iter())
            .flat_map(|claimable| {
                let attempts = i32::try_from(claimable.attempts).unwrap_or(i32::MAX);
                [Value::Bytes(Some(claimable.kind.clone())), attempts.into()]
            })
            .collect();
        let leases = (self.kinds.iter())
            .flat_map(|c| [Value::Bytes(Some(c.kind.clone())), millis(c.lease).into()]);
        let sql = format!(
            "state = CASE WHEN {claimable} THEN {Leased} ELSE {Pending} END, \
             owner = CASE WHEN {claimable} THEN ? ELSE owner END, \
             lease_until = CASE WHEN {claimable} THEN {now} + CASE kind {arms}END \
             ELSE lease_until END, \
             attempts = CASE WHEN {claimable} THEN attempts + 1 ELSE attempts END"
        );
        let mut values = allowed.clone();
        values.extend(allowed.iter().cloned());
        values.push(self.owner.into());
        values.extend(allowed.iter().cloned());
        values.extend(leases);
        values.extend(allowed);
        (sql, values)
    }
}

/// Makes the first queued job of each key in `key_hashes` ready (their heads finished in
/// `txn`), passing over jobs `except` (finishing in `txn` too): how many.
pub(crate) async fn promote(
    txn: &impl ConnectionTrait,
    key_hashes: Vec<Vec<u8>>,
    except: &[i64],
) -> Result<u64, DbErr> {
    Ok(promote_claiming(txn, key_hashes, except, None).await?.0)
}

/// [`promote`], claiming the job it readies with `claiming` when it can: how many it readied,
/// and the job it claimed.
pub(crate) async fn promote_claiming(
    txn: &impl ConnectionTrait,
    key_hashes: Vec<Vec<u8>>,
    except: &[i64],
    claiming: Option<&Claiming<'_>>,
) -> Result<(u64, Option<Taken>), DbErr> {
    if key_hashes.is_empty() {
        return Ok((0, None));
    }
    let backend = txn.get_database_backend();
    if backend != DbBackend::MySql && claiming.is_none() {
        let (sql, values) = promotion(backend, key_hashes, except, None);
        let readied = txn.execute_raw(statement(backend, &sql, values)).await?;
        return Ok((readied.rows_affected(), None));
    }
    read_then_ready(txn, key_hashes, except, claiming).await
}

/// Each key's first queued job found by a plain read (an index scan per key that stops at it,
/// as [`promotion`]'s), then readied — or claimed, when `claiming` can claim it — by an
/// `UPDATE` by id that checks it is still queued: how many it readied, and the job it claimed.
///
/// Always on MySQL/MariaDB, where one statement as elsewhere does not do: an `UPDATE` whose
/// `WHERE` reads its own table (through a derived table, as MySQL requires) scanned and locked
/// every row of the table — 4.5 ms per leased finish on MariaDB with 2,000 jobs in the table
/// (W3), and completions of 8 workers deadlocked one another — and an `UPDATE … ORDER BY id
/// LIMIT 1` locks what it scans, so it waited for another transaction's uncommitted enqueue of
/// the key. A plain read locks nothing and passes over uncommitted rows (a job enqueued so is
/// readied later by the workers' sweep of stranded jobs, `sweep.rs`); a head that stopped being
/// queued between the two (cancelled) is not readied, and the sweep readies its key's next.
/// That is two statements where one was when a job waits behind the key (one when none does).
///
/// Elsewhere for a claiming promotion that rides in no completion (SQLite, or a leased job that
/// failed for good): the read says which job it claimed.
async fn read_then_ready(
    txn: &impl ConnectionTrait,
    key_hashes: Vec<Vec<u8>>,
    except: &[i64],
    claiming: Option<&Claiming<'_>>,
) -> Result<(u64, Option<Taken>), DbErr> {
    let backend = txn.get_database_backend();
    let now = now_ms(backend);
    let columns = format!("id, kind, job_key, payload, attempts, {now} - run_at AS waited");
    let (sql, values) = match <[Vec<u8>; 1]>::try_from(key_hashes) {
        // One key (a finish's): its head read directly — on MariaDB the derived table that
        // `heads` needs for several keys is materialized first (0.26 ms against 0.17).
        Ok([hash]) => head(&columns, hash, except),
        Err(key_hashes) => {
            let (heads, values) = heads(key_hashes, except);
            let sql = format!("SELECT {columns} FROM {JOB_TABLE} WHERE id IN ({heads})");
            (sql, values)
        }
    };
    let rows = txn.query_all_raw(statement(backend, &sql, values)).await?;
    let mut heads = (rows.iter())
        .map(|row| Taken::from_query_result(row, ""))
        .collect::<Result<Vec<_>, _>>()?;
    let claimable = |taken: &Taken| {
        let claiming = claiming?;
        let kind = (claiming.kinds.iter()).find(|claimable| claimable.kind == taken.kind)?;
        let attempts = u32::try_from(taken.attempts).unwrap_or(u32::MAX);
        (taken.waited >= 0 && attempts < kind.attempts).then_some((claiming.owner, kind.lease))
    };
    let mut claimed = None;
    if let Some(at) = heads.iter().position(|taken| claimable(taken).is_some()) {
        let taken = heads.remove(at);
        if let Some((owner, lease)) = claimable(&taken) {
            let sql = format!(
                "UPDATE {JOB_TABLE} SET state = {Leased}, owner = ?, lease_until = {now} + ?, \
                 attempts = attempts + 1 WHERE id = ? AND state = {Queued}"
            );
            let values = vec![owner.into(), millis(lease).into(), taken.id.into()];
            let done = txn.execute_raw(statement(backend, &sql, values)).await?;
            claimed = (done.rows_affected() == 1).then_some(taken);
        }
    }
    let mut readied = u64::from(claimed.is_some());
    if !heads.is_empty() {
        let marks = vec!["?"; heads.len()].join(", ");
        let sql = format!(
            "UPDATE {JOB_TABLE} SET state = {Pending} WHERE id IN ({marks}) AND state = {Queued}"
        );
        let values = heads.iter().map(|taken| Value::from(taken.id)).collect();
        readied += (txn.execute_raw(statement(backend, &sql, values)).await?).rows_affected();
    }
    Ok((readied, claimed))
}

/// MySQL/MariaDB: a finish's promotion that claims ([`Claiming`]), sent after its completion
/// in the same message — the engine's (`store::complete`) or a held transaction's last
/// (`jobs/flights/`) — instead of [`read_then_ready`]'s read and `UPDATE` before it, each a
/// round trip of its own:
///
/// 1. [`find`](Self::find): `SET @freshlock_head = COALESCE(<the check>, <the key's first
///    queued job>)` — the check ([`super::unless_counted`], the completion's count, as the
///    statement right after it) fails the statement (SQLSTATE 21000, which stops the message
///    before its `COMMIT`) unless the completion marked its jobs done under the finish's
///    claim; then the head is found by the same plain read as [`read_then_ready`]'s (it locks
///    nothing and passes over uncommitted rows). A session variable carries the id to the next
///    statement, as no `UPDATE` may read its own table.
/// 2. [`promote`](Self::promote): claims the head by id, or readies it when it cannot be
///    claimed ([`Claiming::set`], as on PostgreSQL), while it is still queued.
/// 3. [`read`](Self::read): the claimed job's row, read back in the transaction (none when the
///    head was readied, not claimed).
///
/// The completion's row is locked before the head's (the other order before): nothing locks a
/// running job's row after a queued one's of its key, so neither order waits on the other.
/// A hot key's leased job is three round trips where it was five with two flights (its finish
/// one message after `BEGIN` and its own statements), five where it was six on the engine
/// (`tests/job_flights.rs` counts them). The variable stays set on the connection until the
/// next such finish sets it again.
#[derive(Clone)]
#[cfg_attr(not(feature = "mysql"), allow(dead_code))]
pub(crate) struct Chained {
    pub(crate) find: sea_orm::Statement,
    /// [`find`](Self::find) without its check, for statements sent one by one (bound, when
    /// their values cannot be written in): there the caller checks the completion's count
    /// itself, and `ROW_COUNT()` would read another statement's (sqlx prepares a statement
    /// before its first run).
    pub(crate) head: sea_orm::Statement,
    pub(crate) promote: sea_orm::Statement,
    pub(crate) read: sea_orm::Statement,
}

#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
impl Chained {
    /// The job it claimed, from the `rows` of [`read`](Self::read).
    pub(crate) fn claimed(&self, rows: &[QueryResult]) -> Result<Option<Taken>, DbErr> {
        rows.first()
            .map(|row| Taken::from_query_result(row, ""))
            .transpose()
    }
}

/// The [`Chained`] promotion of key `key_hash` after a completion of jobs `ids` (under their
/// claim: the completion requires its owner, so its count says whether the claim held).
pub(crate) fn chained(key_hash: Vec<u8>, ids: &[i64], claiming: &Claiming<'_>) -> Chained {
    let backend = DbBackend::MySql;
    let unless_done = super::check::unless_counted(ids.len());
    let (head, values) = head("id", key_hash, ids);
    let find = format!("SET @freshlock_head = COALESCE({unless_done}, ({head}))");
    let unchecked = format!("SET @freshlock_head = ({head})");
    let (set, set_values) = claiming.set(backend);
    let promote =
        format!("UPDATE {JOB_TABLE} SET {set} WHERE id = @freshlock_head AND state = {Queued}");
    let read = format!(
        "SELECT {} FROM {JOB_TABLE} WHERE id = @freshlock_head AND state = {Leased} \
         AND owner = ?",
        claimed_columns(backend)
    );
    Chained {
        find: statement(backend, &find, values.clone()),
        head: statement(backend, &unchecked, values),
        promote: statement(backend, &promote, set_values),
        read: statement(backend, &read, vec![claiming.owner.into()]),
    }
}

/// The job a promotion claimed under `owner` (a token that claims one job, see
/// `JobStep::chaining`), read on its own after the reply that carried it was lost with its
/// `COMMIT`'s and the commit was resolved as made: the worker goes on with it instead of
/// leaving it to wait for its lease to expire. `None` when the promotion claimed nothing (or
/// the claim is gone: its lease expired and another worker took the job).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) async fn claimed_by(
    db: &impl ConnectionTrait,
    owner: &str,
) -> Result<Option<Taken>, DbErr> {
    let backend = db.get_database_backend();
    let sql = format!(
        "SELECT {} FROM {JOB_TABLE} WHERE state = {Leased} AND owner = ?",
        claimed_columns(backend)
    );
    let row = db
        .query_one_raw(statement(backend, &sql, vec![owner.into()]))
        .await?;
    row.map(|row| Taken::from_query_result(&row, ""))
        .transpose()
}

/// The columns a promotion that claimed returns (a [`Taken`]: its attempts before this one).
fn claimed_columns(backend: DbBackend) -> String {
    let now = now_ms(backend);
    format!("id, kind, job_key, payload, attempts - 1 AS attempts, {now} - run_at AS waited")
}

/// PostgreSQL: the promotion as a `WITH` of the completion's statement (`promoted`), with what
/// the completion returns of it beside its own columns — how many it readied (`readied`) and
/// the job it claimed, if any (`next_…`, read by [`claimed_in`]) — and their values.
pub(crate) fn promotion_within(
    key_hashes: Vec<Vec<u8>>,
    except: &[i64],
    claiming: Option<&Claiming<'_>>,
) -> (String, Vec<&'static str>, Vec<Value>) {
    let backend = DbBackend::Postgres;
    let (promotion, values) = promotion(backend, key_hashes, except, claiming);
    let mut returned = vec!["(SELECT COUNT(*) FROM promoted) AS readied"];
    let with = match claiming {
        None => format!("WITH promoted AS ({promotion} RETURNING 1) "),
        Some(_) => {
            returned.extend(NEXT);
            format!(
                "WITH promoted AS ({promotion} RETURNING {}, state = {Leased} AS claimed) ",
                claimed_columns(backend)
            )
        }
    };
    (with, returned, values)
}

/// The claimed job's columns as the completion returns them (one promoted row at most: a
/// claiming promotion readies one key's job).
const NEXT: [&str; 6] = [
    "(SELECT id FROM promoted WHERE claimed) AS next_id",
    "(SELECT kind FROM promoted WHERE claimed) AS next_kind",
    "(SELECT job_key FROM promoted WHERE claimed) AS next_job_key",
    "(SELECT payload FROM promoted WHERE claimed) AS next_payload",
    "(SELECT attempts FROM promoted WHERE claimed) AS next_attempts",
    "(SELECT waited FROM promoted WHERE claimed) AS next_waited",
];

/// The job a completion's row says its promotion claimed ([`promotion_within`]), if any.
pub(crate) fn claimed_in(row: &QueryResult) -> Result<Option<Taken>, DbErr> {
    match row.try_get::<Option<i64>>("", "next_id")? {
        Some(_) => Taken::from_query_result(row, "next_").map(Some),
        None => Ok(None),
    }
}

/// A promotion's `SET`: the job readied, or claimed with `claiming` (see [`Claiming`]).
fn set_of(backend: DbBackend, claiming: Option<&Claiming<'_>>) -> (String, Vec<Value>) {
    match claiming {
        Some(claiming) => claiming.set(backend),
        None => (format!("state = {Pending}"), Vec::new()),
    }
}

/// ` AND id NOT IN (…)` with a placeholder for each of `except`, or nothing.
fn not_in(except: &[i64]) -> String {
    match except.len() {
        0 => String::new(),
        n => format!(" AND id NOT IN ({})", vec!["?"; n].join(", ")),
    }
}

/// The statement of [`promote`] for `key_hashes` off MySQL (see [`promote_each`]), passing
/// over jobs `except`, and its values.
fn promotion(
    backend: DbBackend,
    key_hashes: Vec<Vec<u8>>,
    except: &[i64],
    claiming: Option<&Claiming<'_>>,
) -> (String, Vec<Value>) {
    let (set, mut values) = set_of(backend, claiming);
    let (heads, heads_values) = heads(key_hashes, except);
    values.extend(heads_values);
    // On PostgreSQL the heads' ids are read first (`ARRAY(…)`, run once) and their rows found
    // by the primary key: as `id IN (…)` the planner joined the heads to a scan of the whole
    // table (a hash semi-join, measured at 0.5 ms per completion with 2,000 jobs queued).
    let sql = match backend {
        DbBackend::Postgres => {
            format!("UPDATE {JOB_TABLE} SET {set} WHERE id = ANY(ARRAY({heads}))")
        }
        _ => format!("UPDATE {JOB_TABLE} SET {set} WHERE id IN ({heads})"),
    };
    (sql, values)
}

/// The first queued job of each key in `key_hashes` but jobs `except` (column `id`), and its
/// values. Each key's is found by an index scan that stops at it (`ORDER BY id LIMIT 1` on
/// `freshlock_job_key`): a `MIN(id) … GROUP BY` read every queued job of the key, and a hot key
/// with a thousand waiting made each completion ten times slower.
fn heads(key_hashes: Vec<Vec<u8>>, except: &[i64]) -> (String, Vec<Value>) {
    let mut values = Vec::with_capacity(key_hashes.len() * (1 + except.len()));
    let mut heads = Vec::with_capacity(key_hashes.len());
    for (i, hash) in key_hashes.into_iter().enumerate() {
        let (head, head_values) = head("id", hash, except);
        heads.push(format!("SELECT id FROM ({head}) h{i}"));
        values.extend(head_values);
    }
    (heads.join(" UNION ALL "), values)
}

/// The first queued job of key `key_hash` but jobs `except`, its `columns`, found by an index
/// scan on `freshlock_job_key` that stops at it; and its values.
fn head(columns: &str, key_hash: Vec<u8>, except: &[i64]) -> (String, Vec<Value>) {
    let sql = format!(
        "SELECT {columns} FROM {JOB_TABLE} WHERE key_hash = ? AND state = {Queued}{} \
         ORDER BY id LIMIT 1",
        not_in(except)
    );
    let mut values = vec![Value::Bytes(Some(key_hash))];
    values.extend(except.iter().map(|&id| Value::from(id)));
    (sql, values)
}
