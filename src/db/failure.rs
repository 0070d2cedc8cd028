//! What kind of database failure a `DbErr` is, across SQLite, PostgreSQL and MySQL/MariaDB.

use std::{io, sync::Arc, time::Duration};

use sea_orm::{DbErr, RuntimeErr, SqlErr, sqlx};

/// The failures freshlock treats specially.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// A lock wait ran out (PostgreSQL 55P03, MySQL 1205, 3572 NOWAIT).
    LockTimeout,
    /// The database broke a deadlock by failing this statement (PostgreSQL 40P01, MySQL 1213).
    Deadlock,
    /// A serialization failure (PostgreSQL 40001).
    Serialization,
    /// SQLite's database is busy or locked (codes 5, 6 and their extended forms).
    Busy,
    /// The connection broke: IO and protocol errors, PostgreSQL 57P01 / 57P02 (administrator or
    /// crash shutdown), MySQL / MariaDB 1053 (server shutdown), 1927 (connection killed), 2006 /
    /// 2013 (server gone, lost during a query). Before a `COMMIT` that is transient; while a
    /// `COMMIT` (or an autocommit write) is in flight it leaves the outcome unknown (see
    /// `commit/`).
    ConnectionLost,
    /// No connection could be had: the pool timed out, PostgreSQL 57P03 (cannot connect now),
    /// MySQL / MariaDB 1040 (too many connections). Nothing was sent.
    NoConnection,
    /// A table does not exist (SQLite "no such table", PostgreSQL 42P01, MySQL 1146).
    MissingTable,
    /// A statement met a prepared statement of another client, or missed its own: a pool
    /// behind a transaction pooler without freshlock's settings (PostgreSQL 42P05 duplicate
    /// prepared statement, 26000 no such prepared statement, 08P01 with a parameter count that
    /// does not match the statement). See `transaction_pooler.rs`.
    PoolerClash,
    /// Anything else.
    Other,
}

impl Failure {
    /// Whether running the same transaction again may well succeed.
    pub(crate) fn is_transient(self) -> bool {
        matches!(
            self,
            Self::LockTimeout
                | Self::Deadlock
                | Self::Serialization
                | Self::Busy
                | Self::ConnectionLost
                | Self::NoConnection
        )
    }
}

pub(crate) fn classify(err: &DbErr) -> Failure {
    let sqlx = match err {
        DbErr::Exec(RuntimeErr::SqlxError(e))
        | DbErr::Query(RuntimeErr::SqlxError(e))
        | DbErr::Conn(RuntimeErr::SqlxError(e)) => e,
        DbErr::ConnectionAcquire(_) => return Failure::NoConnection,
        _ => return Failure::Other,
    };
    let db = match sqlx.as_ref() {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => {
            return Failure::ConnectionLost;
        }
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => return Failure::NoConnection,
        other => match other.as_database_error() {
            Some(db) => db,
            None => return Failure::Other,
        },
    };
    #[cfg(feature = "mysql")]
    if let Some(mysql) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return match mysql.number() {
            1205 | 3572 => Failure::LockTimeout,
            1213 => Failure::Deadlock,
            1053 | 1927 | 2006 | 2013 => Failure::ConnectionLost,
            1040 => Failure::NoConnection,
            1146 => Failure::MissingTable,
            _ => Failure::Other,
        };
    }
    let code = db.code();
    match code.as_deref() {
        Some("55P03") => Failure::LockTimeout,
        Some("40P01") => Failure::Deadlock,
        Some("40001") => Failure::Serialization,
        Some("42P01") => Failure::MissingTable,
        Some("57P01" | "57P02") => Failure::ConnectionLost,
        Some("57P03") => Failure::NoConnection,
        Some("42P05" | "26000") => Failure::PoolerClash,
        Some("08P01") if db.message().contains("prepared statement") => Failure::PoolerClash,
        // SQLite: SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes.
        Some(c) if c.parse::<u32>().is_ok_and(|n| matches!(n & 0xff, 5 | 6)) => Failure::Busy,
        _ if db.message().contains("no such table") => Failure::MissingTable,
        _ => Failure::Other,
    }
}

/// Whether `err`, from a write that may have reached the database (a `COMMIT`, an autocommit
/// statement), leaves its outcome unknown.
pub(crate) fn in_doubt(err: &DbErr) -> bool {
    classify(err) == Failure::ConnectionLost
}

/// Whether `err` is PostgreSQL's "transaction ID … is in the future" (`txid_status` of an id the
/// server has not given out: after crash recovery, one whose assignment never reached the WAL).
pub(crate) fn is_future_xid(err: &DbErr) -> bool {
    server_error(err).is_some_and(|db| {
        db.code().as_deref() == Some("22023") && db.message().contains("in the future")
    })
}

/// The error the server answered a statement with, inside `err` (none for a lost connection,
/// a pool's error, or a client-side one).
fn server_error(err: &DbErr) -> Option<&dyn sqlx::error::DatabaseError> {
    let (DbErr::Exec(RuntimeErr::SqlxError(e)) | DbErr::Query(RuntimeErr::SqlxError(e))) = err
    else {
        return None;
    };
    e.as_database_error()
}

/// Whether the server answered with SQLSTATE `code`.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn has_sqlstate(err: &DbErr, code: &str) -> bool {
    server_error(err).is_some_and(|db| db.code().as_deref() == Some(code))
}

/// Whether `err` is SQLSTATE 21000, a subquery used as a value that returned more than one row
/// (PostgreSQL, MySQL/MariaDB 1242): what a check in a message of several statements raises on
/// purpose to stop the message before its `COMMIT` (`jobs/flights/`).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn is_cardinality_violation(err: &DbErr) -> bool {
    has_sqlstate(err, "21000")
}

/// Whether `err` is PostgreSQL's 26000, an `EXECUTE` of a statement the connection has not
/// prepared (`prepared/` prepares it then).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn is_missing_prepared(err: &DbErr) -> bool {
    has_sqlstate(err, "26000")
}

/// Whether `err` is a unique-key violation (a concurrent creator won).
pub(crate) fn is_unique_violation(err: &DbErr) -> bool {
    matches!(err.sql_err(), Some(SqlErr::UniqueConstraintViolation(_)))
}
/// The error of a reply that did not come: an IO time-out, so that `db_error::classify` reads
/// it as a lost connection (transient before a `COMMIT`, in doubt for one).
pub(crate) fn no_reply(bound: Duration) -> DbErr {
    let timed_out = io::Error::new(
        io::ErrorKind::TimedOut,
        format!("no reply from the database within {bound:?}; the connection is dropped"),
    );
    DbErr::Conn(RuntimeErr::SqlxError(Arc::new(sqlx::Error::Io(timed_out))))
}

/// Whether `error` is [`no_reply`]'s: a round trip cut by its deadline, not a connection that
/// failed at once.
pub(crate) fn is_no_reply(error: &DbErr) -> bool {
    match error {
        DbErr::Conn(RuntimeErr::SqlxError(e))
        | DbErr::Exec(RuntimeErr::SqlxError(e))
        | DbErr::Query(RuntimeErr::SqlxError(e)) => {
            matches!(e.as_ref(), sqlx::Error::Io(io) if io.kind() == io::ErrorKind::TimedOut)
        }
        _ => false,
    }
}
