//! Fence counters in `freshlock_lock` for the Redis lease, whose server issues none
//! (`mysql_named` bumps its own in the write's transaction): bumped on every grant (a new row
//! starts one above the fence floor, see [`super::floor`]), checked in the transaction of the
//! write.

use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr};

use super::{
    floor,
    sql::{for_update, lock_error, now_ms, statement},
};
use crate::{db::own::Own, error::LockError, schema::LOCK_TABLE};

/// Issues the next fence of `name` (the bounded, stored name) on `db`.
pub(crate) async fn bump(
    db: &DatabaseConnection,
    backend: DbBackend,
    kind: &'static str,
    name: &str,
    reply: std::time::Duration,
) -> Result<u64, LockError> {
    // A transaction of its own (`db::own`), each round trip bounded; and its round trips
    // together wait at most `reply` (see `deadline.rs`): a bump whose reply never comes fails
    // the grant, whose guard then releases the lease.
    let own = Own::new(db, reply);
    let bumped = own.run(|txn| {
        let name = name.to_owned();
        Box::pin(async move { bump_in(txn, backend, &name).await })
    });
    let bumped = tokio::time::timeout(reply, bumped).await;
    (bumped.unwrap_or_else(|_| Err(crate::db::failure::no_reply(reply))))
        .map_err(|e| lock_error(kind, LOCK_TABLE, e))
}

/// [`bump`] in `txn`.
async fn bump_in(txn: &impl ConnectionTrait, backend: DbBackend, name: &str) -> Result<u64, DbErr> {
    if backend == DbBackend::MySql {
        // `LAST_INSERT_ID(expr)` in the upsert: its own reply carries the fence.
        let done = txn
            .execute_raw(statement(
                backend,
                floor::MYSQL_BUMP_FENCE,
                vec![name.into()],
            ))
            .await?;
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
        .await?;
    let fence = fence
        .map(|row| row.try_get::<i64>("", "fence"))
        .transpose()?
        .unwrap_or(0);
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
