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
        let fence_name = name.bounded(MAX_STORED_NAME, false).into_owned();
        let mut conn = self
            .locks
            .get_mysql_connection_pool()
            .acquire()
            .await
            .map_err(Self::fail)?;
        // The fence is bumped on the lock's own connection (taking a second connection from
        // the lock pool while every connection holds a lock would wait for ever), in the same
        // message as `GET_LOCK` (see `grant_and_bump`).
        let grant = sea_orm::sqlx::raw_sql(sea_orm::sqlx::AssertSqlSafe(grant_and_bump(
            &server_name,
            wait,
            &fence_name,
        )));
        let done = match grant.execute(&mut *conn).await {
            Ok(done) => done,
            Err(e) => {
                // `GET_LOCK` may have been granted before the bump failed: closing the
                // connection makes the server release it.
                conn.close_on_drop();
                return Err(missing_table_or(e));
            }
        };
        // `GET_LOCK`'s SELECT affects no row; the bump one (inserted) or two (updated) when the
        // lock was granted, none when it was not.
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        Ok(Some(Box::new(MySqlNamedGuard {
            conn: Some(conn),
            server_name,
            fence_name,
            fence: done.last_insert_id(),
        })))
    }
}

/// `GET_LOCK` and the fence bump of [`super::floor::MYSQL_BUMP_FENCE`] as one multi-statement
/// message (one round trip where two were), the bump made only when this connection now holds
/// the lock (`HAVING IS_USED_LOCK(…) = CONNECTION_ID()`: the floor's aggregate row is filtered
/// out otherwise). A message of several statements cannot be prepared, so the names travel in
/// the SQL text: as hexadecimal literals converted to `utf8mb4` — the bytes of the name,
/// whatever they hold (quotes, backslashes, NUL), and read the same under every `sql_mode`
/// (`NO_BACKSLASH_ESCAPES`, `ANSI_QUOTES`), where an escaped string literal would not be.
fn grant_and_bump(server_name: &str, wait: Duration, fence_name: &str) -> String {
    let (lock, fence) = (utf8_literal(server_name), utf8_literal(fence_name));
    let bump = super::floor::MYSQL_BUMP_FENCE
        .replacen("SELECT ?,", &format!("SELECT {fence},"), 1)
        .replacen(
            "LOCK IN SHARE MODE",
            &format!("HAVING IS_USED_LOCK({lock}) = CONNECTION_ID() LOCK IN SHARE MODE"),
            1,
        );
    // MariaDB returns NULL for a negative timeout: waits are never negative here.
    format!("SELECT GET_LOCK({lock}, {:.3}); {bump}", wait.as_secs_f64())
}

/// `text` as an SQL expression of MySQL/MariaDB that no `sql_mode` reads otherwise:
/// `CONVERT(X'…' USING utf8mb4)`.
fn utf8_literal(text: &str) -> String {
    use std::fmt::Write as _;
    let mut literal = String::with_capacity(text.len() * 2 + 24);
    literal.push_str("CONVERT(X'");
    for byte in text.bytes() {
        let _ = write!(literal, "{byte:02x}");
    }
    literal.push_str("' USING utf8mb4)");
    literal
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

    fn fence_row(&self) -> Option<&str> {
        Some(&self.fence_name)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grant_is_one_message_with_no_placeholder_and_a_guarded_bump() {
        let sql = grant_and_bump("a'b\\c", Duration::from_millis(1500), "n\0'");
        let lock = "CONVERT(X'6127625c63' USING utf8mb4)";
        assert!(
            sql.starts_with(&format!("SELECT GET_LOCK({lock}, 1.500); INSERT INTO ")),
            "{sql}"
        );
        assert!(sql.contains("SELECT CONVERT(X'6e0027' USING utf8mb4), LAST_INSERT_ID("));
        assert!(sql.contains(&format!(
            "HAVING IS_USED_LOCK({lock}) = CONNECTION_ID() LOCK IN SHARE MODE ON DUPLICATE"
        )));
        assert!(!sql.contains('?'), "{sql}");
        assert_eq!(sql.matches(';').count(), 1, "two statements: {sql}");
    }
}
