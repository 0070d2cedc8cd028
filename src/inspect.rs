//! The lock inspector: what the `freshlock locks` and `freshlock release` commands do, as
//! library functions.
//!
//! It reads the `freshlock_lock` table (the `table` backend's leases). Expiry is judged by the
//! database clock, in the same statement that reads or clears, so a lease that is live is never
//! cleared. [`compact`] deletes the lock rows nobody needs, keeping every name's fences growing.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Value};

use crate::{
    database::Db,
    db::{begin, deadline::DEFAULT_REPLY, own::Own, pool::Pool},
    error::{Result, database},
    lock::sql::{for_update, for_update_skip_locked, millis, now_ms, statement},
    schema::{FLOOR_NAME, LOCK_TABLE, ROW_LOCK_TABLE, insert_floor},
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

/// Which held leases [`held_locks`] lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Held {
    /// Every held lease.
    All,
    /// Only leases that have run out (their holders stopped, hung or lost the database).
    Expired,
}

/// The leases held in `db`, oldest first: all of them, or just those that have run out.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when the query fails (for example, the migration was not run).
pub async fn held_locks(db: &impl ConnectionTrait, which: Held) -> Result<Vec<HeldLock>> {
    let backend = db.get_database_backend();
    let now = now_ms(backend);
    let filter = if which == Held::Expired {
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
/// clock); returns how many. Fences stay: the rows are kept (see [`compact`]).
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

/// What [`compact`] deleted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Compacted {
    /// Rows deleted from `freshlock_lock`: free leases and fence counters idle for the period.
    pub lock_rows: u64,
    /// Rows deleted from `freshlock_row_lock` (the `row` backend's; none is locked).
    pub row_lock_rows: u64,
    /// The fence floor afterwards: every name's next fence is above it.
    pub floor: i64,
}

/// Rows deleted per transaction.
const BATCH: usize = 500;

/// Deletes the lock rows nobody needs, keeping every name's fences growing:
///
/// - from `freshlock_lock`, the rows that nobody holds (released leases; the fence counters of
///   the `mysql_named` and `redis` backends) and that were last granted at least `idle` ago by
///   the database clock. The fence floor (see [`crate::schema`]) is raised to the highest fence
///   deleted, in the same transaction, and a name's next row starts above it. First grants of
///   new names wait while a batch is deleted (PostgreSQL: a `SHARE ROW EXCLUSIVE` table lock,
///   waited for at most 5 s; MySQL/MariaDB: the floor row; SQLite: the one writer); other
///   grants, checks and releases do not. Live and expired-but-unreleased leases are kept (clear
///   those with [`release_stale`] first). A `redis` holder whose grant is older than `idle` may
///   lose its fence row: its next write then reports [`crate::UpdateOutcome::LeaseLost`] and
///   writes nothing. A `mysql_named` holder loses nothing: its next checked transaction writes
///   the row again, above the raised floor (a transaction holding the row is waited for).
/// - from `freshlock_row_lock`, every row no transaction has locked now (`SKIP LOCKED`): a
///   section that locks a deleted name creates its row again.
///
/// Runs in batches of 500 rows, one short transaction each.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when a statement fails (a batch's transaction is
/// rolled back; the batches before it stay done).
pub async fn compact(db: impl Into<Db>, idle: Duration) -> Result<Compacted> {
    let db = db.into();
    let db = db.pool();
    let mut compacted = Compacted::default();
    let fail = |e| database("compacting", &LOCK_TABLE, e);
    loop {
        let (deleted, floor) = compact_leases(db, idle).await.map_err(fail)?;
        compacted.lock_rows += deleted as u64;
        compacted.floor = floor;
        if deleted < BATCH {
            break;
        }
    }
    loop {
        let deleted = compact_row_locks(db)
            .await
            .map_err(|e| database("compacting", &ROW_LOCK_TABLE, e))?;
        compacted.row_lock_rows += deleted as u64;
        if deleted < BATCH {
            break;
        }
    }
    Ok(compacted)
}

/// One batch of `freshlock_lock`: how many rows were deleted, and the floor after.
async fn compact_leases(db: &Pool, idle: Duration) -> std::result::Result<(usize, i64), DbErr> {
    let own = Own::new(db, DEFAULT_REPLY).with(begin::options(db).await);
    own.run(|txn| Box::pin(compact_leases_in(txn, idle))).await
}

/// [`compact_leases`] in `txn`.
async fn compact_leases_in(
    txn: &impl ConnectionTrait,
    idle: Duration,
) -> std::result::Result<(usize, i64), DbErr> {
    let backend = txn.get_database_backend();
    if backend == DbBackend::Postgres {
        // Writers of the table wait until this batch commits, and take their statement's
        // snapshot after: a first grant then reads the raised floor. Bounded, so a long wait
        // does not queue every lock statement behind it.
        txn.execute_unprepared("SET LOCAL lock_timeout = '5s'")
            .await?;
        txn.execute_unprepared(&format!(
            "LOCK TABLE {LOCK_TABLE} IN SHARE ROW EXCLUSIVE MODE"
        ))
        .await?;
    }
    insert_floor(txn).await?;
    let lock = for_update(backend);
    let read_floor = format!("SELECT fence FROM {LOCK_TABLE} WHERE name = ?{lock}");
    let floor: i64 = txn
        .query_one_raw(statement(backend, &read_floor, vec![FLOOR_NAME.into()]))
        .await?
        .map(|row| row.try_get::<i64>("", "fence"))
        .transpose()?
        .unwrap_or(0);
    let skip = if backend == DbBackend::Sqlite {
        ""
    } else {
        " SKIP LOCKED"
    };
    let now = now_ms(backend);
    let candidates = format!(
        "SELECT name, fence FROM {LOCK_TABLE} \
         WHERE name <> ? AND owner IS NULL AND COALESCE(acquired_at, 0) <= {now} - ? \
         ORDER BY name LIMIT {BATCH}{lock}{skip}"
    );
    let rows = txn
        .query_all_raw(statement(
            backend,
            &candidates,
            vec![FLOOR_NAME.into(), millis(idle).into()],
        ))
        .await?;
    let mut names = Vec::with_capacity(rows.len());
    let mut top = floor;
    for row in &rows {
        names.push(Value::from(row.try_get::<String>("", "name")?));
        top = top.max(row.try_get::<i64>("", "fence")?);
    }
    if !names.is_empty() {
        let marks = vec!["?"; names.len()].join(", ");
        let delete = format!("DELETE FROM {LOCK_TABLE} WHERE owner IS NULL AND name IN ({marks})");
        txn.execute_raw(statement(backend, &delete, names.clone()))
            .await?;
        let raise = format!("UPDATE {LOCK_TABLE} SET fence = ? WHERE name = ? AND fence < ?");
        txn.execute_raw(statement(
            backend,
            &raise,
            vec![top.into(), FLOOR_NAME.into(), top.into()],
        ))
        .await?;
    }
    Ok((names.len(), top))
}

/// One batch of `freshlock_row_lock`: how many rows were deleted.
async fn compact_row_locks(db: &Pool) -> std::result::Result<usize, DbErr> {
    let own = Own::new(db, DEFAULT_REPLY);
    own.run(|txn| Box::pin(compact_row_locks_in(txn))).await
}

/// [`compact_row_locks`] in `txn`.
async fn compact_row_locks_in(txn: &impl ConnectionTrait) -> std::result::Result<usize, DbErr> {
    let backend = txn.get_database_backend();
    let skip = for_update_skip_locked(backend);
    let select = format!("SELECT name FROM {ROW_LOCK_TABLE} ORDER BY name LIMIT {BATCH}{skip}");
    let rows = txn
        .query_all_raw(statement(backend, &select, vec![]))
        .await?;
    let names = rows
        .iter()
        .map(|row| row.try_get::<String>("", "name").map(Value::from))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if !names.is_empty() {
        let marks = vec!["?"; names.len()].join(", ");
        let delete = format!("DELETE FROM {ROW_LOCK_TABLE} WHERE name IN ({marks})");
        txn.execute_raw(statement(backend, &delete, names.clone()))
            .await?;
    }
    Ok(names.len())
}
