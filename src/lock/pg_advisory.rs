//! PostgreSQL transaction-level advisory locks.

use std::time::Duration;

use async_trait::async_trait;
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, Value};

use super::{
    LocalLock, name::LockName, sql::statement, traits::TransactionLock, wait::with_lock_timeout,
};
use crate::error::LockError;

const KIND: &str = "pg_advisory";

/// `pg_advisory_xact_lock` on the 64-bit [`LockName::stable_hash`] of the name, inside the
/// `locked_update` transaction: released by its commit or rollback, so it can neither leak onto a
/// pooled connection nor outlive a crashed holder, and needs no table. The wait is bounded with
/// `lock_timeout`. Uncontended, it costs one statement (`pg_try_advisory_xact_lock`), and none
/// for `locked_update`, whose reload tries it in its own `WHERE`.
///
/// PostgreSQL only: on other databases it fails with [`LockError::Unsupported`]. Two names
/// with the same 64-bit hash share a lock (harmless: they only serialize more).
#[derive(Clone, Debug, Default)]
pub struct PgAdvisoryLock {
    /// This backend's in-process queue (see [`LockBackend::queue`]), shared by its clones.
    queue: LocalLock,
}

impl PgAdvisoryLock {
    /// The advisory-lock backend.
    pub fn new() -> Self {
        Self::default()
    }

    /// The advisory-lock key of `name`: its stable hash as a `bigint`.
    pub fn key(name: &LockName) -> i64 {
        i64::from_ne_bytes(name.stable_hash().to_ne_bytes())
    }
}

super::outside::outside_backend!(PgAdvisoryLock, PgAdvisory, Transaction);

#[async_trait]
impl TransactionLock for PgAdvisoryLock {
    async fn lock_in_transaction(
        &self,
        txn: &DatabaseTransaction,
        name: &LockName,
        wait: Duration,
    ) -> Result<bool, LockError> {
        let backend = txn.get_database_backend();
        if backend != DbBackend::Postgres {
            return Err(LockError::Unsupported {
                backend: KIND,
                database: format!("{backend:?}"),
            });
        }
        let fail = |e| LockError::Backend {
            backend: KIND,
            source: Box::new(e),
        };
        let key = Value::from(Self::key(name));
        let try_lock = statement(
            backend,
            "SELECT pg_try_advisory_xact_lock(?) AS locked",
            vec![key.clone()],
        );
        let row = txn.query_one_raw(try_lock).await.map_err(fail)?;
        let locked = row
            .map(|r| r.try_get::<bool>("", "locked"))
            .transpose()
            .map_err(fail)?
            .unwrap_or(false);
        if locked || wait.is_zero() {
            return Ok(locked);
        }
        let blocking = statement(backend, "SELECT pg_advisory_xact_lock(?)", vec![key]);
        with_lock_timeout(txn, wait, async {
            txn.execute_raw(blocking.clone()).await.map(|_| ())
        })
        .await
        .map(|locked| locked.is_some())
        .map_err(fail)
    }
}
