//! Leased jobs' claim, its check at the finish, its heartbeat, and the reclaim of expired
//! leases.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbErr};

use crate::jobs::state::Stored::{Leased, Pending};
use crate::{
    db::{autocommit::upkeep, pool::Pool},
    lock::sql::{for_update, millis, now_ms, statement},
    schema::JOB_TABLE,
};

/// Claims job `id` (locked by `txn`'s take) for attempt `attempts` under a lease of `lease`
/// held by `owner`: once `txn` commits, the job works outside any transaction and its key stays
/// busy until the claim ends ([`hold`], [`complete`], [`failed`]) or expires ([`reclaim`]).
pub(crate) async fn claim(
    txn: &impl ConnectionTrait,
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
pub(crate) async fn hold(txn: &impl ConnectionTrait, id: i64, owner: &str) -> Result<bool, DbErr> {
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
