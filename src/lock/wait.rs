//! Bounded waits for row and advisory locks inside a transaction.

use std::{future::Future, time::Duration};

use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, DbErr};

use super::sql::statement;
use crate::db::failure::{Failure, classify};

/// Runs `wait_for_lock` (a statement that blocks on a lock) with the wait bounded by `wait`, and
/// restores the connection's setting afterwards. Returns `Ok(None)` when the wait ran out.
///
/// PostgreSQL: `lock_timeout`, set for this transaction only. After a timeout PostgreSQL has
/// aborted the transaction: the caller must roll it back (`locked_update` does, and starts a new
/// one if it proceeds without the lock). MySQL/MariaDB: `innodb_lock_wait_timeout`, whole seconds
/// (rounded up, at least 1), restored to the server default afterwards.
pub(crate) async fn with_lock_timeout<T>(
    txn: &DatabaseTransaction,
    wait: Duration,
    wait_for_lock: impl Future<Output = Result<T, DbErr>>,
) -> Result<Option<T>, DbErr> {
    let backend = txn.get_database_backend();
    let restore = match backend {
        DbBackend::Postgres => {
            let ms = wait.as_millis().max(1).to_string() + "ms";
            let set = "SELECT current_setting('lock_timeout') AS previous, set_config('lock_timeout', ?, true)";
            let row = txn
                .query_one_raw(statement(backend, set, vec![ms.into()]))
                .await?;
            let previous = row
                .map(|r| r.try_get::<String>("", "previous"))
                .transpose()?
                .unwrap_or_else(|| "0".to_owned());
            Some(previous)
        }
        DbBackend::MySql => {
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            let set = format!("SET SESSION innodb_lock_wait_timeout = {}", secs.max(1));
            txn.execute_unprepared(&set).await?;
            None
        }
        _ => None,
    };
    let outcome = match wait_for_lock.await {
        Ok(value) => Ok(Some(value)),
        Err(e) if classify(&e) == Failure::LockTimeout => Ok(None),
        Err(e) => Err(e),
    };
    match (backend, restore) {
        (DbBackend::Postgres, Some(previous)) if matches!(outcome, Ok(Some(_))) => {
            let reset = "SELECT set_config('lock_timeout', ?, true)";
            txn.execute_raw(statement(backend, reset, vec![previous.into()]))
                .await?;
        }
        (DbBackend::MySql, _) => {
            txn.execute_unprepared("SET SESSION innodb_lock_wait_timeout = DEFAULT")
                .await?;
        }
        _ => {}
    }
    outcome
}
