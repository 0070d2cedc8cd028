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
/// three statements on one row where one does; on PostgreSQL the claimed row comes back in the
/// completion's own reply (see [`super::complete`]).
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
    /// The promotion's `SET` and its values. Every assignment reads only columns assigned after
    /// it or never (MySQL assigns left to right, each assignment seeing the ones before it).
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
    let Some(first) = key_hashes.first().cloned() else {
        return Ok((0, None));
    };
    let backend = txn.get_database_backend();
    let (sql, values) = promotion(backend, key_hashes, except, claiming);
    let readied = (txn.execute_raw(statement(backend, &sql, values)).await?).rows_affected();
    let claimed = match claiming {
        Some(claiming) if readied > 0 => claimed_by(txn, &first, claiming.owner).await?,
        _ => None,
    };
    Ok((readied, claimed))
}

/// The job of key `key_hash` that `owner`'s promotion claimed, if it did.
async fn claimed_by(
    txn: &impl ConnectionTrait,
    key_hash: &[u8],
    owner: &str,
) -> Result<Option<Taken>, DbErr> {
    let backend = txn.get_database_backend();
    let sql = format!(
        "SELECT {} FROM {JOB_TABLE} WHERE key_hash = ? AND state = {Leased} AND owner = ?",
        claimed_columns(backend, "")
    );
    let values = vec![Value::Bytes(Some(key_hash.to_vec())), owner.into()];
    match txn.query_one_raw(statement(backend, &sql, values)).await? {
        Some(row) => Taken::from_query_result(&row, "").map(Some),
        None => Ok(None),
    }
}

/// The columns a claimed job is read back with (a [`Taken`], its attempts before this one),
/// each named with `prefix`.
fn claimed_columns(backend: DbBackend, prefix: &str) -> String {
    let now = now_ms(backend);
    format!(
        "id AS {prefix}id, kind AS {prefix}kind, job_key AS {prefix}job_key, \
         payload AS {prefix}payload, attempts - 1 AS {prefix}attempts, \
         {now} - run_at AS {prefix}waited"
    )
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
                claimed_columns(backend, "")
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

/// The statement of [`promote`] for `key_hashes`, passing over jobs `except`, and its values.
/// Off MySQL each key's first queued job is found by an index scan that stops at it (`ORDER BY
/// id LIMIT 1` on `freshlock_job_key`): a `MIN(id) … GROUP BY` read every queued job of the
/// key, and a hot key with a thousand waiting made each completion ten times slower. On MySQL
/// the `UNION ALL` of such scans made 8 workers' completions deadlock one another (InnoDB locks
/// what an `UPDATE`'s subquery reads), so it keeps the one grouped read — even for one key,
/// whose scan alone deadlocked the same way (`jobs.rs` `run_until_idle_leaves_nothing_mysql`).
fn promotion(
    backend: DbBackend,
    key_hashes: Vec<Vec<u8>>,
    except: &[i64],
    claiming: Option<&Claiming<'_>>,
) -> (String, Vec<Value>) {
    let (set, mut values) = match claiming {
        Some(claiming) => claiming.set(backend),
        None => (format!("state = {Pending}"), Vec::new()),
    };
    let except_sql = match except.len() {
        0 => String::new(),
        n => format!(" AND id NOT IN ({})", vec!["?"; n].join(", ")),
    };
    let heads = if backend == DbBackend::MySql {
        let placeholders = vec!["?"; key_hashes.len()].join(", ");
        values.extend(key_hashes.into_iter().map(|h| Value::Bytes(Some(h))));
        values.extend(except.iter().map(|&id| Value::from(id)));
        format!(
            "SELECT MIN(id) AS id FROM {JOB_TABLE} WHERE state = {Queued} \
             AND key_hash IN ({placeholders}){except_sql} GROUP BY key_hash"
        )
    } else {
        let mut heads = Vec::with_capacity(key_hashes.len());
        for (i, hash) in key_hashes.into_iter().enumerate() {
            heads.push(format!(
                "SELECT id FROM (SELECT id FROM {JOB_TABLE} WHERE key_hash = ? \
                 AND state = {Queued}{except_sql} ORDER BY id LIMIT 1) h{i}"
            ));
            values.push(Value::Bytes(Some(hash)));
            values.extend(except.iter().map(|&id| Value::from(id)));
        }
        heads.join(" UNION ALL ")
    };
    // The derived table lets MySQL read the table it updates.
    let sql = format!("UPDATE {JOB_TABLE} SET {set} WHERE id IN (SELECT id FROM ({heads}) heads)");
    (sql, values)
}
