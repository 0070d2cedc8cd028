//! Fence counters in `freshlock_lock` for lease backends whose server issues none (MySQL
//! `GET_LOCK`, Redis): bumped on every grant, checked in the transaction of the write.

use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend};
#[cfg(feature = "redis")]
use sea_orm::{DatabaseConnection, TransactionTrait};

use super::sql::{lock_error, statement};
use crate::{error::LockError, schema::LOCK_TABLE};

/// Issues the next fence of `name` (the bounded, stored name) on `db`.
#[cfg(feature = "redis")]
pub(crate) async fn bump(
    db: &DatabaseConnection,
    backend: DbBackend,
    kind: &'static str,
    name: &str,
) -> Result<u64, LockError> {
    let fail = |e| lock_error(kind, LOCK_TABLE, e);
    let txn = db.begin().await.map_err(fail)?;
    let fence = if backend == DbBackend::MySql {
        let upsert = format!(
            "INSERT INTO {LOCK_TABLE} (name, fence, expires_at) VALUES (?, 1, 0) \
             ON DUPLICATE KEY UPDATE fence = fence + 1"
        );
        txn.execute_raw(statement(backend, &upsert, vec![name.into()]))
            .await
            .map_err(fail)?;
        let read = format!("SELECT fence FROM {LOCK_TABLE} WHERE name = ?");
        txn.query_one_raw(statement(backend, &read, vec![name.into()]))
            .await
            .map_err(fail)?
    } else {
        let upsert = format!(
            "INSERT INTO {LOCK_TABLE} (name, fence, expires_at) VALUES (?, 1, 0) \
             ON CONFLICT (name) DO UPDATE SET fence = {LOCK_TABLE}.fence + 1 RETURNING fence"
        );
        txn.query_one_raw(statement(backend, &upsert, vec![name.into()]))
            .await
            .map_err(fail)?
    };
    let fence = fence
        .map(|row| row.try_get::<i64>("", "fence"))
        .transpose()
        .map_err(fail)?
        .unwrap_or(0);
    txn.commit().await.map_err(fail)?;
    Ok(u64::try_from(fence).unwrap_or(0))
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
    let lock = if backend == DbBackend::Sqlite {
        ""
    } else {
        " FOR UPDATE"
    };
    let sql = format!("SELECT fence FROM {LOCK_TABLE} WHERE name = ? AND fence = ?{lock}");
    let fence = i64::try_from(fence).unwrap_or(i64::MAX);
    let row = txn
        .query_one_raw(statement(backend, &sql, vec![name.into(), fence.into()]))
        .await
        .map_err(|e| lock_error(kind, LOCK_TABLE, e))?;
    Ok(row.is_some())
}
