//! `BEGIN` as freshlock's writes begin: at the isolation a locked write needs, on a live
//! connection, and never cut in half.

use sea_orm::{
    DatabaseTransaction, DbBackend, DbErr, IsolationLevel, SqliteTransactionMode,
    TransactionOptions,
};

use super::pool::Pool;

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
/// is the pool's default already (PostgreSQL's; see [`Pool::read_committed_by_default`]).
pub(crate) async fn begin(db: &Pool) -> std::result::Result<DatabaseTransaction, DbErr> {
    let options = match db.get_database_backend() {
        DbBackend::Sqlite => TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..TransactionOptions::default()
        },
        // Already the pool's default: a plain `BEGIN` (one round trip instead of two).
        _ if db.read_committed_by_default().await => TransactionOptions::default(),
        _ => TransactionOptions {
            isolation_level: Some(IsolationLevel::ReadCommitted),
            ..TransactionOptions::default()
        },
    };
    crate::db::live::begin(db, options).await
}
