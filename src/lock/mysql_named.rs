//! MySQL / MariaDB named locks (`GET_LOCK`).

use std::time::Duration;

use async_trait::async_trait;
use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbBackend,
    sqlx::{MySql, pool::PoolConnection},
};
use tracing::warn;

use super::{
    fence,
    kind::LockKind,
    name::LockName,
    traits::{Fencing, LeaseLock, LockBackend, LockGuard, LockRole},
};
use crate::{
    error::LockError,
    schema::{LOCK_TABLE, MAX_STORED_NAME},
};

const KIND: &str = "mysql_named";
/// MySQL refuses longer names (error 3057).
const MAX_NAME: usize = 64;

/// `GET_LOCK` / `RELEASE_LOCK` on a connection held for the lock's whole life, taken from a pool
/// used only for locks (so that waiting for a lock never takes the connection the work needs).
///
/// A named lock belongs to its connection: it survives commit and rollback, is released by
/// `RELEASE_LOCK` after the transaction ended, and by the server when the connection closes (a
/// crashed holder frees it at once; a guard dropped without `release` closes its connection
/// instead of returning it to the pool with the lock held). Names longer than 64 characters or
/// not ASCII are mapped to a stable 64-character name. Waits are always finite (MariaDB returns
/// NULL for a negative timeout). Each grant bumps a fence in `freshlock_lock`, checked in the
/// write's transaction.
///
/// `locks` must reach the same database as the data. Needs [`crate::schema::Migration`].
///
/// Not a cluster lock: on a MariaDB Galera cluster `GET_LOCK` is local to the node that ran
/// it, so writers on two nodes would both hold one name. [`crate::LockKind::connect`] refuses
/// such a cluster; use `local`, `row` or `table` there (see the README's "Topologies").
#[derive(Clone, Debug)]
pub struct MySqlNamedLock {
    locks: DatabaseConnection,
}

impl MySqlNamedLock {
    /// Named locks on connections of `locks` (a pool of its own; each held lock keeps one
    /// connection).
    ///
    /// # Errors
    /// [`LockError::Unsupported`] when `locks` is not a MySQL/MariaDB connection.
    pub fn new(locks: DatabaseConnection) -> Result<Self, LockError> {
        if locks.get_database_backend() != DbBackend::MySql {
            return Err(LockError::Unsupported {
                backend: KIND,
                database: format!("{:?}", locks.get_database_backend()),
            });
        }
        Ok(Self { locks })
    }

    fn fail(e: impl std::error::Error + Send + Sync + 'static) -> LockError {
        LockError::Backend {
            backend: KIND,
            source: Box::new(e),
        }
    }
}

impl LockBackend for MySqlNamedLock {
    fn kind(&self) -> LockKind {
        LockKind::MySqlNamed
    }

    fn role(&self) -> LockRole<'_> {
        LockRole::Lease(self)
    }
}

#[async_trait]
impl LeaseLock for MySqlNamedLock {
    async fn acquire(
        &self,
        name: &LockName,
        wait: Duration,
        _ttl: Duration,
    ) -> Result<Option<Box<dyn LockGuard>>, LockError> {
        let server_name = name.bounded(MAX_NAME, true).into_owned();
        let mut conn = self
            .locks
            .get_mysql_connection_pool()
            .acquire()
            .await
            .map_err(Self::fail)?;
        let got: Option<i64> = sea_orm::sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(&server_name)
            .bind(wait.as_secs_f64())
            .fetch_one(&mut *conn)
            .await
            .map_err(Self::fail)?;
        if got != Some(1) {
            return Ok(None);
        }
        let mut guard = MySqlNamedGuard {
            conn: None,
            server_name,
            fence_name: name.bounded(MAX_STORED_NAME, false).into_owned(),
            fence: 0,
        };
        // The fence is bumped on the lock's own connection: taking a second connection from the
        // lock pool while every connection holds a lock would wait for ever.
        let bumped = bump_on(&mut conn, &guard.fence_name).await;
        guard.conn = Some(conn);
        // Dropping `guard` on error closes the connection, which frees the named lock.
        guard.fence = bumped?;
        Ok(Some(Box::new(guard)))
    }
}

/// Issues the next fence of `name` on `conn`: the upsert writes it with `LAST_INSERT_ID(expr)`,
/// so its own reply (the OK packet's insert id) carries it — one round trip.
async fn bump_on(conn: &mut PoolConnection<MySql>, name: &str) -> Result<u64, LockError> {
    // A new row starts one above the fence floor (read under a shared lock, see `floor.rs`).
    let done = sea_orm::sqlx::query(super::floor::MYSQL_BUMP_FENCE)
        .bind(name)
        .execute(&mut **conn)
        .await
        .map_err(missing_table_or)?;
    Ok(done.last_insert_id())
}

/// The error of a fence statement, naming the migration when the table is missing.
fn missing_table_or(e: sea_orm::sqlx::Error) -> LockError {
    let missing = e
        .as_database_error()
        .and_then(|db| db.try_downcast_ref::<sea_orm::sqlx::mysql::MySqlDatabaseError>())
        .is_some_and(|db| db.number() == 1146);
    if missing {
        return LockError::MissingTable {
            table: LOCK_TABLE,
            migration: crate::schema::MIGRATION_NAME,
        };
    }
    MySqlNamedLock::fail(e)
}

/// A held named lock and its connection.
#[derive(Debug)]
struct MySqlNamedGuard {
    conn: Option<PoolConnection<MySql>>,
    server_name: String,
    fence_name: String,
    fence: u64,
}

#[async_trait]
impl LockGuard for MySqlNamedGuard {
    fn fencing(&self) -> Option<&dyn Fencing> {
        Some(self)
    }

    async fn retire(mut self: Box<Self>) -> Result<(), LockError> {
        // While the named lock is held, on its own connection: no other grant bumps the row.
        const RETIRE: &str = "DELETE FROM freshlock_lock WHERE name = ? AND fence = ? AND \
            fence <= (SELECT bound FROM (SELECT COALESCE(MAX(fence), 0) + 1 AS bound \
            FROM freshlock_lock WHERE name = '') AS floor_row)";
        if let Some(conn) = self.conn.as_mut() {
            let deleted = sea_orm::sqlx::query(RETIRE)
                .bind(&self.fence_name)
                .bind(i64::try_from(self.fence).unwrap_or(i64::MAX))
                .execute(&mut **conn)
                .await;
            if let Err(error) = deleted {
                warn!(lock = %self.server_name, %error, "deleting the fence row of a missing key failed");
            }
        }
        self.release().await
    }

    async fn release(mut self: Box<Self>) -> Result<(), LockError> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        let released: Result<Option<i64>, _> =
            sea_orm::sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
                .bind(&self.server_name)
                .fetch_one(&mut *conn)
                .await;
        match released {
            // Back to the pool only when the server says the lock is gone.
            Ok(_) => Ok(()),
            Err(e) => {
                conn.close_on_drop();
                Err(MySqlNamedLock::fail(e))
            }
        }
    }
}

#[async_trait]
impl Fencing for MySqlNamedGuard {
    fn fence(&self) -> u64 {
        self.fence
    }

    async fn verify(&self, txn: &DatabaseTransaction) -> Result<bool, LockError> {
        fence::verify(txn, KIND, &self.fence_name, self.fence).await
    }
}

impl Drop for MySqlNamedGuard {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            // Never hand a connection that holds a named lock to the next borrower: closing it
            // makes the server release the lock.
            warn!(lock = %self.server_name, "named lock dropped without release; closing its connection");
            conn.close_on_drop();
        }
    }
}
