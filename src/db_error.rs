//! What kind of database failure a `DbErr` is, across SQLite, PostgreSQL and MySQL/MariaDB.

use sea_orm::{DbErr, RuntimeErr};

/// The failures freshlock treats specially.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// A lock wait ran out (PostgreSQL 55P03, MySQL 1205, 3572 NOWAIT).
    LockTimeout,
    /// The database broke a deadlock by failing this statement (PostgreSQL 40P01, MySQL 1213).
    Deadlock,
    /// A table does not exist (SQLite "no such table", PostgreSQL 42P01, MySQL 1146).
    MissingTable,
    /// Anything else.
    Other,
}

pub(crate) fn classify(err: &DbErr) -> Failure {
    let sqlx = match err {
        DbErr::Exec(RuntimeErr::SqlxError(e))
        | DbErr::Query(RuntimeErr::SqlxError(e))
        | DbErr::Conn(RuntimeErr::SqlxError(e)) => e,
        _ => return Failure::Other,
    };
    let Some(db) = sqlx.as_database_error() else {
        return Failure::Other;
    };
    #[cfg(feature = "mysql")]
    if let Some(mysql) = db.try_downcast_ref::<sea_orm::sqlx::mysql::MySqlDatabaseError>() {
        return match mysql.number() {
            1205 | 3572 => Failure::LockTimeout,
            1213 => Failure::Deadlock,
            1146 => Failure::MissingTable,
            _ => Failure::Other,
        };
    }
    match db.code().as_deref() {
        Some("55P03") => Failure::LockTimeout,
        Some("40P01") => Failure::Deadlock,
        Some("42P01") => Failure::MissingTable,
        _ if db.message().contains("no such table") => Failure::MissingTable,
        _ => Failure::Other,
    }
}
