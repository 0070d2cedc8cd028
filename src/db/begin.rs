//! `BEGIN` as freshlock's writes begin: at the isolation a locked write needs, on a live
//! connection, and never cut in half.

use sea_orm::{
    DatabaseTransaction, DbBackend, DbErr, IsolationLevel, SqliteTransactionMode,
    TransactionOptions,
};

use sea_orm::{ConnectionTrait, Statement};
use tracing::debug;

use super::{autocommit::autocommit, pool::Pool};

/// The text that begins a transaction as [`begin`] does, for a message of several statements
/// (`held.rs`, `write/flights/`): at READ COMMITTED unless that is the pool's default already.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn text(db: &Pool) -> &'static str {
    let options = options(db).await;
    match (db.get_database_backend(), options.isolation_level.is_some()) {
        (DbBackend::MySql, true) => {
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION"
        }
        (DbBackend::MySql, false) => "START TRANSACTION",
        (_, true) => "BEGIN ISOLATION LEVEL READ COMMITTED",
        (_, false) => "BEGIN",
    }
}

/// [`begin`] in a task of its own, awaited: a caller dropped while `BEGIN` is in flight must not
/// cut it in half, because sqlx counts the transaction only once `BEGIN`'s reply is read — a
/// connection whose `BEGIN` reply was never read goes back to the pool inside a transaction
/// nobody ends (the next `SET TRANSACTION` on it fails with MySQL 1568). The task finishes the
/// `BEGIN`, and if nobody takes the transaction, dropping it rolls it back.
pub(crate) async fn begin_detached(db: &Pool) -> std::result::Result<DatabaseTransaction, DbErr> {
    let db = db.clone();
    match tokio::spawn(async move { begin(&db).await }).await {
        Ok(began) => began,
        Err(e) => Err(DbErr::Custom(format!("beginning a transaction: {e}"))),
    }
}

/// `BEGIN IMMEDIATE` on SQLite (a DEFERRED transaction that reads, then writes fails with
/// "database is locked" without waiting), `READ COMMITTED` elsewhere (under REPEATABLE READ the
/// snapshot could predate the lock and the reload be stale) — set by `SET TRANSACTION` unless it
/// is the pool's default already (PostgreSQL's; see [`read_committed_by_default`]).
pub(crate) async fn begin(db: &Pool) -> std::result::Result<DatabaseTransaction, DbErr> {
    crate::db::live::begin(db, options(db).await).await
}

/// The options of [`begin`]'s `BEGIN` on `db`.
pub(crate) async fn options(db: &Pool) -> TransactionOptions {
    match db.get_database_backend() {
        DbBackend::Sqlite => TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..TransactionOptions::default()
        },
        // Already the pool's default: a plain `BEGIN` (one round trip instead of two).
        _ if read_committed_by_default(db).await => TransactionOptions::default(),
        _ => TransactionOptions {
            isolation_level: Some(IsolationLevel::ReadCommitted),
            ..TransactionOptions::default()
        },
    }
}

/// Whether a transaction begun on `db` runs at READ COMMITTED without being told to: the
/// server's default for new transactions, read once per pool (PostgreSQL's default; MariaDB's
/// and MySQL's default is REPEATABLE READ, so there the answer is usually no). `false` when it
/// cannot be read, and for SQLite, whose transactions have no isolation levels.
///
/// A pool whose connections change their default after connecting (a `SET SESSION
/// CHARACTERISTICS` run by the application on some of them) is not seen: set the default in the
/// connection URL or the server instead. On PostgreSQL a stricter level would not lose updates
/// either — a reload or write of a row changed since the snapshot fails with a serialization
/// error, which freshlock retries.
async fn read_committed_by_default(db: &Pool) -> bool {
    let backend = db.get_database_backend();
    // MariaDB before 11.1 names the variable `tx_isolation`, MySQL 8 only
    // `transaction_isolation`: `SHOW VARIABLES` finds whichever the server has (both hold
    // the session's level), where selecting the other name would fail on every `BEGIN`.
    let (query, column) = match backend {
        DbBackend::Postgres => ("SHOW default_transaction_isolation", 0),
        DbBackend::MySql => (
            "SHOW SESSION VARIABLES WHERE Variable_name IN ('tx_isolation', 'transaction_isolation')",
            1,
        ),
        _ => return false,
    };
    if !db.is_real() {
        return false;
    }
    if let Some(answer) = db.read_committed().get() {
        return *answer;
    }
    let level = match autocommit(db)
        .query_one_raw(Statement::from_string(backend, query))
        .await
    {
        Ok(Some(row)) => row.try_get_by_index::<String>(column).ok(),
        Ok(None) => None,
        Err(error) => {
            // Not remembered: a database that is down now is asked again on the next BEGIN.
            debug!(%error, "reading the default isolation level failed; BEGIN sets it");
            return false;
        }
    };
    let answer = level.is_some_and(|level| {
        level.eq_ignore_ascii_case("read committed") || level.eq_ignore_ascii_case("READ-COMMITTED")
    });
    *db.read_committed().get_or_init(|| answer)
}
