//! What kind of database failure a `DbErr` is, across SQLite, PostgreSQL and MySQL/MariaDB.

use sea_orm::{DbErr, RuntimeErr, sqlx};

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
    /// The connection broke, or none could be had in time.
    ConnectionLost,
    /// A table does not exist (SQLite "no such table", PostgreSQL 42P01, MySQL 1146).
    MissingTable,
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
        )
    }
}

pub(crate) fn classify(err: &DbErr) -> Failure {
    let sqlx = match err {
        DbErr::Exec(RuntimeErr::SqlxError(e))
        | DbErr::Query(RuntimeErr::SqlxError(e))
        | DbErr::Conn(RuntimeErr::SqlxError(e)) => e,
        DbErr::ConnectionAcquire(_) => return Failure::ConnectionLost,
        _ => return Failure::Other,
    };
    let db = match sqlx.as_ref() {
        sqlx::Error::Io(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed => return Failure::ConnectionLost,
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
        // SQLite: SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes.
        Some(c) if c.parse::<u32>().is_ok_and(|n| matches!(n & 0xff, 5 | 6)) => Failure::Busy,
        _ if db.message().contains("no such table") => Failure::MissingTable,
        _ => Failure::Other,
    }
}
