//! Fence counters in `freshlock_lock` for the Redis lease, whose server issues none
//! (`mysql_named` bumps its own in the write's transaction): bumped on every grant (a new row
//! starts one above the fence floor, see [`super::floor`]), checked in the transaction of the
//! write.

use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend};

use super::{
    floor,
    sql::{for_update, lock_error, now_ms, statement},
};
use crate::{error::LockError, schema::LOCK_TABLE};

/// Issues the next fence of `name` (the bounded, stored name) on `db`.
pub(crate) async fn bump(
    db: &DatabaseConnection,
    backend: DbBackend,
    kind: &'static str,
    name: &str,
    reply: std::time::Duration,
) -> Result<u64, LockError> {
    // Its round trips together wait at most `reply` (see `deadline.rs`): a bump whose reply
    // never comes fails the grant, whose guard then releases the lease.
    tokio::time::timeout(reply, bump_now(db, backend, kind, name))
        .await
        .unwrap_or_else(|_| {
            Err(lock_error(
                kind,
                LOCK_TABLE,
                crate::db::failure::no_reply(reply),
            ))
        })
}

async fn bump_now(
    db: &DatabaseConnection,
    backend: DbBackend,
    kind: &'static str,
    name: &str,
) -> Result<u64, LockError> {
    let fail = |e| lock_error(kind, LOCK_TABLE, e);
    // Never cut in half by `bump`'s deadline (see `detach::begin`), and on a live connection.
    let txn = crate::db::live::begin(db, sea_orm::TransactionOptions::default())
        .await
        .map_err(fail)?;
    if backend == DbBackend::MySql {
        // `LAST_INSERT_ID(expr)` in the upsert: its own reply carries the fence.
        let done = txn
            .execute_raw(statement(
                backend,
                floor::MYSQL_BUMP_FENCE,
                vec![name.into()],
            ))
            .await
            .map_err(fail)?;
        txn.commit().await.map_err(fail)?;
        return Ok(done.last_insert_id());
    }
    let upsert = format!(
        "INSERT INTO {LOCK_TABLE} (name, fence, expires_at, acquired_at) \
         VALUES (?, {first}, 0, {now}) \
         ON CONFLICT (name) DO UPDATE SET fence = {LOCK_TABLE}.fence + 1, \
         acquired_at = excluded.acquired_at RETURNING fence",
        first = floor::first_fence(),
        now = now_ms(backend),
    );
    let fence = txn
        .query_one_raw(statement(backend, &upsert, vec![name.into()]))
        .await
        .map_err(fail)?;
    let fence = fence
        .map(|row| row.try_get::<i64>("", "fence"))
        .transpose()
        .map_err(fail)?
        .unwrap_or(0);
    txn.commit().await.map_err(fail)?;
    Ok(u64::try_from(fence).unwrap_or(0))
}

/// Deletes the fence row of `name` when it still holds `fence` and has no fence above the floor
/// but that one (see [`LockGuard::retire`](super::traits::LockGuard::retire)). Call it while the lock
/// is still held, so no other grant bumps the row meanwhile. Returns whether it was deleted.
pub(crate) async fn retire(
    db: &DatabaseConnection,
    kind: &'static str,
    name: &str,
    fence: u64,
) -> Result<bool, LockError> {
    let backend = db.get_database_backend();
    let fence = i64::try_from(fence).unwrap_or(i64::MAX);
    let delete = floor::retire_sql("fence = ?");
    let done = db
        .execute_raw(statement(backend, &delete, vec![name.into(), fence.into()]))
        .await
        .map_err(|e| lock_error(kind, LOCK_TABLE, e))?;
    Ok(done.rows_affected() == 1)
}

/// Whether `fence` is still the newest grant of `name`. Locks the counter row until the
/// transaction ends (SQLite: `BEGIN IMMEDIATE` already excludes), so no newer grant can be issued
/// between this check and the commit.
pub(crate) async fn verify(
    txn: &DatabaseTransaction,
    kind: &'static str,
    name: &str,
    fence: u64,
) -> Result<bool, LockError> {
    let backend = txn.get_database_backend();
    let lock = for_update(backend);
    let sql = format!("SELECT fence FROM {LOCK_TABLE} WHERE name = ? AND fence = ?{lock}");
    let fence = i64::try_from(fence).unwrap_or(i64::MAX);
    let row = txn
        .query_one_raw(statement(backend, &sql, vec![name.into(), fence.into()]))
        .await
        .map_err(|e| lock_error(kind, LOCK_TABLE, e))?;
    Ok(row.is_some())
}
