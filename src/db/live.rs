//! Connections that died while idle in the pool: a server restart, a killed session or an idle
//! timeout ends them without the pool knowing, and a pool without sqlx's checkout ping
//! (`test_before_acquire(false)`, one round trip less per transaction) hands them out. The first
//! statement on such a connection fails at once; when nothing had begun on it (a `BEGIN`, a
//! read), another connection is tried.

use sea_orm::{DatabaseConnection, DatabaseTransaction, DbErr, TransactionOptions};
use tracing::debug;

use crate::db::failure::{Failure, classify};

/// `BEGIN` (with `options`) on a connection of `db`, never cut in half (`detach::begin`), and
/// tried on another connection when the one the pool handed out had died idle: nothing had begun
/// on it. Every `BEGIN` of a locked write, section, claim and fence bump goes through here.
pub(crate) async fn begin(
    db: &DatabaseConnection,
    options: TransactionOptions,
) -> Result<DatabaseTransaction, DbErr> {
    on_live_connection(db, || crate::db::detach::begin(db, options)).await
}

/// How many connections `db`'s pool holds now (idle or in use); 0 for a mock.
pub(crate) fn size(db: &DatabaseConnection) -> u32 {
    use sea_orm::DatabaseConnectionType as Type;
    match &db.inner {
        #[cfg(feature = "sqlite")]
        Type::SqlxSqlitePoolConnection(_) => db.get_sqlite_connection_pool().size(),
        #[cfg(feature = "postgres")]
        Type::SqlxPostgresPoolConnection(_) => db.get_postgres_connection_pool().size(),
        #[cfg(feature = "mysql")]
        Type::SqlxMySqlPoolConnection(_) => db.get_mysql_connection_pool().size(),
        _ => 0,
    }
}

/// Runs `first` — the first statement on a connection of `db`'s pool that has not done anything
/// yet: a `BEGIN`, or one idempotent read outside any transaction (a `load`) — and runs it again
/// when it failed on a lost connection. A connection that the server closed while it sat idle in
/// the pool (a restart, a killed session, an idle timeout) fails its first statement at once,
/// and a pool without sqlx's checkout ping (`test_before_acquire(false)`, one round trip less per
/// transaction) hands such connections out; sqlx drops each one that failed. So it is tried once
/// more than the pool has connections (at least twice): after a restart every idle connection is
/// dead. A reply that did not come within its deadline is not tried again. Writes
/// outside a transaction are never run again here (one whose connection broke may have
/// happened); the locked paths run their whole transaction again instead.
pub(crate) async fn on_live_connection<T, F, Fut>(
    db: &DatabaseConnection,
    mut first: F,
) -> Result<T, DbErr>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, DbErr>>,
{
    // The pool as it is before the first try: sqlx drops each dead connection, so its size
    // shrinks while they are found.
    let tries = size(db).saturating_add(1).max(2);
    let mut tried = 1;
    loop {
        match first().await {
            Err(error) if tried < tries && dead(&error) => {
                debug!(%error, tried, "a connection of the pool was dead; trying another");
                tried += 1;
            }
            done => return done,
        }
    }
}

/// Whether `error` is a connection that failed at once (closed, reset, ended by the server) —
/// not a reply that did not come within its deadline: the database is slow or unreachable then,
/// and another connection would wait as long.
fn dead(error: &DbErr) -> bool {
    classify(error) == Failure::ConnectionLost && !crate::db::failure::is_no_reply(error)
}
