//! MySQL / MariaDB named locks (`GET_LOCK`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, RuntimeErr,
    sqlx::{MySql, Row as _, pool::PoolConnection},
};
use tracing::{debug, warn};

use super::{
    LocalLock,
    name::LockName,
    sql::{lock_error, statement},
    traits::{Acquired, Fencing, LeaseLock, LockGuard},
};
use crate::{
    db::deadline::reply_bound,
    db::failure::{Failure, classify},
    error::LockError,
    lock::bound::lock_no_reply,
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
/// NULL for a negative timeout).
///
/// Fences: a grant writes nothing (it commits nothing, so it costs no log flush). Each
/// transaction it protects bumps the name's fence in `freshlock_lock` when it is checked
/// ([`Fencing::verify`]), only while the grant's connection still holds the name and a second
/// named lock (a token of its own) — checked under the fence row's lock — and the commit of the
/// write carries the bump; the fence row stays locked until then, and a grant waits in its reply
/// for a transaction that holds it. So
/// [`Fencing::fence`] is 0 until the first transaction was checked, and then that transaction's
/// fence: fences grow with every checked transaction of the name.
///
/// A grant whose message finds its pooled connection dead (closed by the server while it
/// idled: a restart, `wait_timeout`) is asked again on another connection, so the pool needs no
/// ping on checkout; [`crate::LockKind::connect`]'s pool has none.
///
/// `locks` must reach the same database as the data. Needs [`crate::schema::Migration`].
///
/// Not a cluster lock: on a MariaDB Galera cluster `GET_LOCK` is local to the node that ran
/// it, so writers on two nodes would both hold one name. [`crate::LockKind::connect`] refuses
/// such a cluster; use `local` or `table` there (see [topologies](crate::guide::topologies)).
#[derive(Clone, Debug)]
pub struct MySqlNamedLock {
    locks: DatabaseConnection,
    /// This backend's in-process queue (see [`LockBackend::queue`]), shared by its clones.
    queue: LocalLock,
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
        Ok(Self {
            locks,
            queue: LocalLock::new(),
        })
    }

    fn fail(e: impl std::error::Error + Send + Sync + 'static) -> LockError {
        LockError::Backend {
            backend: KIND,
            source: Box::new(e),
        }
    }
}

super::outside::outside_backend!(MySqlNamedLock, MySqlNamed, Lease);

#[async_trait]
impl LeaseLock for MySqlNamedLock {
    async fn acquire(&self, name: &LockName, wait: Duration, ttl: Duration) -> Acquired {
        let server_name = name.bounded(MAX_NAME, true).into_owned();
        let fence_name = name.bounded(MAX_STORED_NAME, false).into_owned();
        let token = token();
        let pool = self.locks.get_mysql_connection_pool();
        // Every connection the pool holds now may have died while it idled (a server restart,
        // `wait_timeout`): one more try than there are, each on another connection.
        let tries = pool.size() + 1;
        let reply = reply_bound(ttl);
        let started = tokio::time::Instant::now();
        let mut tried = 0;
        let (mut conn, granted) = loop {
            tried += 1;
            let mut conn = pool.acquire().await.map_err(Self::fail)?;
            let waits = wait.saturating_sub(started.elapsed());
            let grant = sea_orm::sqlx::raw_sql(sea_orm::sqlx::AssertSqlSafe(grant(
                &server_name,
                waits,
                &token,
                &fence_name,
            )));
            // `GET_LOCK` answers within its wait; a reply later than that by more than a reply's
            // bound is not coming (a silent partition, see `deadline.rs`). Closing the
            // connection then makes the server release whatever it granted, once it notices.
            let bound = waits.saturating_add(reply);
            let Ok(replied) = tokio::time::timeout(bound, grant.fetch_all(&mut *conn)).await else {
                return Err(silent(conn, bound));
            };
            match replied {
                // The variables are the last row (the fence row, when read, comes before).
                Ok(rows) => {
                    let granted = rows.last().map(|row| {
                        let owner = row.try_get::<i64, _>(1).map(|id| u64::try_from(id).ok());
                        (row.try_get::<Option<i64>, _>(0), owner)
                    });
                    // The server's timer may end a wait a little before the caller's clock
                    // does (seen: 299.6 ms of a 300 ms budget): a refusal before the budget
                    // asks again for what is left, so a wait always lasts its whole budget.
                    if matches!(granted, Some((Ok(Some(0)), _))) && started.elapsed() < wait {
                        tried -= 1;
                        continue;
                    }
                    break (conn, granted);
                }
                Err(e) => {
                    // `GET_LOCK` may have been granted before the wait failed: closing the
                    // connection makes the server release it.
                    conn.close_on_drop();
                    let e = DbErr::Query(RuntimeErr::SqlxError(Arc::new(e)));
                    // A pooled connection found dead by the grant's message, the first it was
                    // sent since it idled (`LockKind::connect`'s pool does not ping on
                    // checkout): the grant is asked again on another connection.
                    if classify(&e) == Failure::ConnectionLost && tried < tries {
                        debug!(lock = %server_name, error = %e, "a pooled lock connection was dead; asking again on another");
                        continue;
                    }
                    return Err(lock_error(KIND, LOCK_TABLE, e));
                }
            }
        };
        match granted {
            Some((Ok(Some(0)), _)) => Ok(None),
            Some((Ok(Some(2)), Ok(Some(owner)))) => Ok(Some(Box::new(MySqlNamedGuard {
                conn: Some(conn),
                reply,
                server_name,
                token,
                owner,
                fence_name,
                fence: AtomicU64::new(0),
            }))),
            // The name granted without its token (or an unreadable reply): nothing to fence
            // with, so let the server release both with the connection.
            other => {
                conn.close_on_drop();
                Err(Self::fail(std::io::Error::other(format!(
                    "GET_LOCK of the grant's token failed: {other:?}"
                ))))
            }
        }
    }
}

/// A reply on `conn` that did not come within `bound` (see `deadline.rs`): the connection is
/// closed, which makes the server release its named locks once it notices, and the grant or
/// release fails as on a lost connection.
fn silent(mut conn: PoolConnection<MySql>, bound: Duration) -> LockError {
    conn.close_on_drop();
    lock_no_reply(KIND, bound)
}

/// A name no other grant ever takes: the second named lock of a grant, held on the same
/// connection as the name itself and so lost with it. [`MySqlNamedGuard::verify`] checks that it
/// (and the name) are still held by the grant's connection — the connection's id alone could be
/// another's after a server restart, a fresh token cannot. 128 bits from the standard library's
/// randomly keyed hasher (no crate for it).
fn token() -> String {
    use std::hash::BuildHasher as _;
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let count = COUNT.fetch_add(1, Ordering::Relaxed);
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seed = (std::process::id(), clock, count);
    let (a, b) = (
        std::hash::RandomState::new().hash_one(seed),
        std::hash::RandomState::new().hash_one(seed),
    );
    format!("freshlock:{a:016x}{b:016x}")
}

/// The grant as one message of three statements (one round trip): `GET_LOCK` of the name and,
/// only when granted, of the grant's [`token`] (`@freshlock_grant` is 2 when both are held, 0
/// when the name was not granted), with the connection's id; then, only when granted, a
/// shared-lock read of the name's fence row; then the two variables, as the reply's last row.
/// The read waits for a transaction that holds the row — one whose lease was lost while its
/// [`verify`](MySqlNamedGuard::verify) had bumped the row — to end: this grant then reads
/// nothing that transaction had not committed yet. A read, not a write: a grant commits nothing
/// (no log flush), unlike a fence bumped at the grant. A message of several statements cannot
/// be prepared, so the names travel in the SQL text: as hexadecimal literals converted to
/// `utf8mb4` — the bytes of the name, whatever they hold (quotes, backslashes, NUL), and read
/// the same under every `sql_mode` (`NO_BACKSLASH_ESCAPES`, `ANSI_QUOTES`), where an escaped
/// string literal would not be.
fn grant(server_name: &str, wait: Duration, token: &str, fence_name: &str) -> String {
    let (lock, token, fence) = (
        utf8_literal(server_name),
        utf8_literal(token),
        utf8_literal(fence_name),
    );
    // MariaDB returns NULL for a negative timeout: waits are never negative here. `SELECT …
    // INTO` (MySQL deprecates assigning variables inside expressions). A user variable in a
    // `WHERE` is a constant of the statement: a false one reads (and waits for) nothing.
    format!(
        "SELECT IF(GET_LOCK({lock}, {wait:.3}) = 1, GET_LOCK({token}, 0) + 1, 0), CONNECTION_ID() \
         INTO @freshlock_grant, @freshlock_owner; \
         SELECT fence FROM {LOCK_TABLE} WHERE name = {fence} AND @freshlock_grant = 2 \
         LOCK IN SHARE MODE; \
         SELECT @freshlock_grant AS granted, CAST(@freshlock_owner AS SIGNED) AS owner",
        // Whole milliseconds, rounded up: a wait is never cut short by its spelling.
        wait = wait.as_micros().div_ceil(1000) as f64 / 1000.0
    )
}

/// The grant is still held: the name and the grant's token both held by its connection (values:
/// the name, the connection's id, the token, the id again). The name alone could be held by a
/// connection that was given the same id after a server restart; the token alone could outlive
/// the name for the moment the server takes to release a dead connection's locks one by one.
const HELD: &str = "IS_USED_LOCK(?) = ? AND IS_USED_LOCK(?) = ?";

/// [`HELD`] by a statement of its own.
const CHECK_HELD: &str = "SELECT IS_USED_LOCK(?) = ? AND IS_USED_LOCK(?) = ? AS held";

/// The fence bump of [`super::floor::MYSQL_BUMP_FENCE`] made only while the grant is [`HELD`],
/// checked after the fence row is locked: an existing row is locked by the upsert before its
/// `UPDATE` clause runs, whose `IF` checks and bumps (or leaves the row exactly as it was: one
/// row found, none changed); a new row is inserted only when the check before it held (`HAVING`: the floor's
/// aggregate row is filtered out otherwise), and the check is then made again by a statement of
/// its own (see [`MySqlNamedGuard::verify`]). A check made before the row is locked would leave
/// a moment in which the grant is lost, the next grant's read of the row (which waits only for a
/// locked row) passes, and this transaction then writes under the lost grant.
fn checked_bump() -> &'static str {
    // Built once: every checked transaction sends it.
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        super::floor::MYSQL_BUMP_FENCE
        .replacen(
            "LOCK IN SHARE MODE",
            &format!("HAVING {HELD} LOCK IN SHARE MODE"),
            1,
        )
        .replacen(
            "fence = LAST_INSERT_ID(freshlock_lock.fence + 1)",
            &format!(
                "fence = IF({HELD}, LAST_INSERT_ID(freshlock_lock.fence + 1), freshlock_lock.fence)"
            ),
            1,
        )
        // The row is left exactly as it was when the check fails: two rows affected then mean
        // a bumped fence, never only a new `acquired_at`.
        .replacen(
            &format!("acquired_at = {NOW_MS}"),
            &format!("acquired_at = IF({HELD}, {NOW_MS}, freshlock_lock.acquired_at)"),
            1,
        )
    });
    &SQL
}

/// `floor::MYSQL_BUMP_FENCE`'s clock.
const NOW_MS: &str = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";

/// `text` as an SQL expression of MySQL/MariaDB that no `sql_mode` reads otherwise:
/// `CONVERT(X'…' USING utf8mb4)`.
fn utf8_literal(text: &str) -> String {
    format!(
        "CONVERT({} USING utf8mb4)",
        crate::db::inline::mysql::hex(text.as_bytes())
    )
}

/// A held named lock and its connection.
#[derive(Debug)]
struct MySqlNamedGuard {
    conn: Option<PoolConnection<MySql>>,
    /// The bound on each reply on `conn` (see `deadline.rs`).
    reply: Duration,
    server_name: String,
    /// The grant's second named lock (see [`token`]).
    token: String,
    /// The id of the connection holding both.
    owner: u64,
    fence_name: String,
    /// The fence issued by the last transaction [`Fencing::verify`] checked; 0 before.
    fence: AtomicU64,
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
        if let Some(mut conn) = self.conn.take() {
            let deleted = sea_orm::sqlx::query(RETIRE)
                .bind(&self.fence_name)
                .bind(i64::try_from(self.fence.load(Ordering::SeqCst)).unwrap_or(i64::MAX))
                .execute(&mut *conn);
            match tokio::time::timeout(self.reply, deleted).await {
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    warn!(lock = %self.server_name, %error, "deleting the fence row of a missing key failed");
                }
                // No reply: the connection is closed (its locks with it), not released.
                Err(_) => return Err(silent(conn, self.reply)),
            }
            self.conn = Some(conn);
        }
        self.release().await
    }

    async fn release(mut self: Box<Self>) -> Result<(), LockError> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        let released = sea_orm::sqlx::query_scalar::<_, Option<i64>>(
            "SELECT RELEASE_LOCK(?), RELEASE_LOCK(?)",
        )
        .bind(&self.server_name)
        .bind(&self.token)
        .fetch_one(&mut *conn);
        match tokio::time::timeout(self.reply, released).await {
            // Back to the pool only when the server says the lock is gone.
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => {
                conn.close_on_drop();
                Err(MySqlNamedLock::fail(e))
            }
            // No reply within the bound (a silent partition): the call does not wait for the
            // server to notice the closed connection.
            Err(_) => Err(silent(conn, self.reply)),
        }
    }
}

#[async_trait]
impl Fencing for MySqlNamedGuard {
    fn fence(&self) -> u64 {
        self.fence.load(Ordering::SeqCst)
    }

    /// Bumps the name's fence in `txn` while the name and the grant's token are still held by
    /// its connection ([`HELD`], checked under the row's lock, see [`checked_bump`]): the fence
    /// row then stays locked until `txn` ends, so a later grant (possible only once this one is
    /// lost) waits for `txn` in its read of that row before it reads anything else.
    /// Each transaction checked gets a fence of its own, and its commit carries the bump: a
    /// grant writes nothing of its own.
    async fn verify(&self, txn: &DatabaseTransaction) -> Result<bool, LockError> {
        let held = || -> Vec<sea_orm::Value> {
            vec![
                self.server_name.as_str().into(),
                self.owner.into(),
                self.token.as_str().into(),
                self.owner.into(),
            ]
        };
        let mut values = vec![self.fence_name.as_str().into()];
        // The check before an insert, the check of the fence's and of `acquired_at`'s update.
        for _ in 0..3 {
            values.extend(held());
        }
        let fail = |e| lock_error(KIND, LOCK_TABLE, e);
        let done = txn
            .execute_raw(statement(DbBackend::MySql, checked_bump(), values))
            .await
            .map_err(fail)?;
        // Insert id 0: the check before the insert failed, nothing was written. Two rows
        // affected: an existing row's fence bumped, its check made under its lock; the insert
        // id is the fence. One (sqlx counts found rows): a new row inserted after a check made
        // before it, or an existing row left exactly as it was because the check under its
        // lock failed (the insert id is then the select's, no fence) — either way the check is
        // made again, now that the row is locked.
        let fence = done.last_insert_id();
        if fence == 0 {
            return Ok(false);
        }
        if done.rows_affected() == 1 {
            let row = txn
                .query_one_raw(statement(DbBackend::MySql, CHECK_HELD, held()))
                .await
                .map_err(fail)?;
            let held = row.and_then(|row| row.try_get::<Option<i64>>("", "held").ok().flatten());
            if held != Some(1) {
                return Ok(false);
            }
        }
        self.fence.store(fence, Ordering::SeqCst);
        Ok(true)
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
    fn the_grant_is_one_message_with_no_placeholder_and_a_gated_read() {
        let sql = grant("a'b\\c", Duration::from_millis(1500), "t'", "n\0'");
        let lock = "CONVERT(X'6127625C63' USING utf8mb4)";
        let token = "CONVERT(X'7427' USING utf8mb4)";
        assert!(
            sql.starts_with(&format!(
                "SELECT IF(GET_LOCK({lock}, 1.500) = 1, GET_LOCK({token}, 0) + 1, 0), CONNECTION_ID() \
                 INTO @freshlock_grant, @freshlock_owner; "
            )),
            "{sql}"
        );
        assert!(sql.ends_with(
            "SELECT @freshlock_grant AS granted, CAST(@freshlock_owner AS SIGNED) AS owner"
        ));
        assert!(sql.contains(
            "WHERE name = CONVERT(X'6E0027' USING utf8mb4) AND @freshlock_grant = 2 LOCK IN SHARE MODE"
        ));
        assert!(!sql.contains('?'), "{sql}");
        assert_eq!(sql.matches(';').count(), 2, "three statements: {sql}");
    }

    #[test]
    fn the_bump_checks_the_name_and_the_token_before_an_insert_and_under_the_row_lock() {
        let sql = checked_bump();
        assert!(sql.contains(&format!(
            "HAVING {HELD} LOCK IN SHARE MODE ON DUPLICATE KEY"
        )));
        assert!(sql.contains(&format!(
            "fence = IF({HELD}, LAST_INSERT_ID(freshlock_lock.fence + 1), freshlock_lock.fence)"
        )));
        assert!(sql.contains(&format!(
            "acquired_at = IF({HELD}, {NOW_MS}, freshlock_lock.acquired_at)"
        )));
        assert_eq!(sql.matches('?').count(), 13, "{sql}");
        assert!(CHECK_HELD.contains(HELD));
    }

    #[test]
    fn tokens_differ() {
        let (a, b) = (token(), token());
        assert_ne!(a, b);
        assert!(a.len() <= MAX_NAME, "{a}");
    }
}
