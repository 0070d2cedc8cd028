//! The lock inspector: what the `freshlock locks` command shows, as library functions.
//!
//! It reads the `freshlock_lock` table (the `table` backend's leases). Expiry is judged by the
//! database clock, in the same statement that reads or clears, so a lease that is live is never
//! cleared.

use sea_orm::{ConnectionTrait, DbErr};

use crate::{
    error::{Result, database},
    lock::sql::{now_ms, statement},
    schema::LOCK_TABLE,
};

/// One held (or expired but not yet taken over) lease.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldLock {
    /// The lock's stored name.
    pub name: String,
    /// The holder's host.
    pub host: Option<String>,
    /// The holder's process id.
    pub pid: Option<i64>,
    /// The holder's label.
    pub label: Option<String>,
    /// When it was granted (ms since the Unix epoch, database clock).
    pub acquired_at_ms: Option<i64>,
    /// When the lease runs out (ms since the Unix epoch, database clock).
    pub expires_at_ms: i64,
    /// The fence of this grant.
    pub fence: i64,
    /// Whether the lease has run out (by the database clock, when read).
    pub expired: bool,
}

fn read(row: &sea_orm::QueryResult) -> std::result::Result<HeldLock, DbErr> {
    Ok(HeldLock {
        name: row.try_get("", "name")?,
        host: row.try_get("", "host")?,
        pid: row.try_get("", "pid")?,
        label: row.try_get("", "label")?,
        acquired_at_ms: row.try_get("", "acquired_at")?,
        expires_at_ms: row.try_get("", "expires_at")?,
        fence: row.try_get("", "fence")?,
        expired: flag(row, "expired")?,
    })
}

/// A `CASE … THEN 1 ELSE 0 END` column: INT4 on PostgreSQL, BIGINT on MySQL/MariaDB, INTEGER
/// on SQLite.
fn flag(row: &sea_orm::QueryResult, column: &str) -> std::result::Result<bool, DbErr> {
    row.try_get::<i64>("", column)
        .or_else(|_| row.try_get::<i32>("", column).map(i64::from))
        .map(|value| value != 0)
}

/// The leases held in `db`, oldest first; with `expired_only`, just those that have run out.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when the query fails (for example, the migration was not run).
pub async fn held_locks(db: &impl ConnectionTrait, expired_only: bool) -> Result<Vec<HeldLock>> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let filter = if expired_only {
        format!(" AND expires_at <= {now}")
    } else {
        String::new()
    };
    let sql = format!(
        "SELECT name, host, pid, label, acquired_at, expires_at, fence, \
         CASE WHEN expires_at <= {now} THEN 1 ELSE 0 END AS expired \
         FROM {LOCK_TABLE} WHERE owner IS NOT NULL{filter} ORDER BY acquired_at, name"
    );
    let fail = |e| database("listing locks in", &LOCK_TABLE, e);
    let rows = db
        .query_all_raw(statement(backend, &sql, vec![]))
        .await
        .map_err(fail)?;
    rows.iter()
        .map(read)
        .collect::<std::result::Result<_, _>>()
        .map_err(fail)
}

/// Clears the leases that have run out (expiry re-checked in the same statement, by the database
/// clock); returns how many. Fences stay: rows are never deleted.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when the update fails.
pub async fn release_stale(db: &impl ConnectionTrait) -> Result<u64> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let sql = format!(
        "UPDATE {LOCK_TABLE} SET owner = NULL, expires_at = 0 \
         WHERE owner IS NOT NULL AND expires_at <= {now}"
    );
    let cleared = db
        .execute_raw(statement(backend, &sql, vec![]))
        .await
        .map_err(|e| database("releasing stale locks in", &LOCK_TABLE, e))?;
    Ok(cleared.rows_affected())
}
