//! What freshlock knows of a connection pool: its identity, and whether its transactions already
//! run at READ COMMITTED (then `BEGIN` needs no `SET TRANSACTION`: one round trip less per
//! locked write).

use std::{
    mem::{Discriminant, discriminant},
    sync::{Arc, OnceLock},
};

use dashmap::DashMap;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use tracing::debug;

/// The address of the pool's connect options, shared by every clone of one pool and by no other
/// live pool; `None` for a connection that is not a sqlx pool (a mock).
pub(crate) fn identity(db: &DatabaseConnection) -> Option<usize> {
    use sea_orm::DatabaseConnectionType as Type;
    match &db.inner {
        #[cfg(feature = "sqlite")]
        Type::SqlxSqlitePoolConnection(_) => Some(
            Arc::as_ptr(&db.get_sqlite_connection_pool().connect_options()).cast::<()>() as usize,
        ),
        #[cfg(feature = "postgres")]
        Type::SqlxPostgresPoolConnection(_) => Some(
            Arc::as_ptr(&db.get_postgres_connection_pool().connect_options()).cast::<()>() as usize,
        ),
        #[cfg(feature = "mysql")]
        Type::SqlxMySqlPoolConnection(_) => Some(
            Arc::as_ptr(&db.get_mysql_connection_pool().connect_options()).cast::<()>() as usize,
        ),
        _ => None,
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
pub(crate) async fn read_committed_by_default(db: &DatabaseConnection) -> bool {
    static KNOWN: OnceLock<DashMap<(usize, Discriminant<DbBackend>), bool>> = OnceLock::new();
    let backend = db.get_database_backend();
    let query = match backend {
        DbBackend::Postgres => "SHOW default_transaction_isolation",
        DbBackend::MySql => "SELECT @@tx_isolation",
        _ => return false,
    };
    let Some(id) = identity(db) else {
        return false;
    };
    let known = KNOWN.get_or_init(DashMap::new);
    if let Some(answer) = known.get(&(id, discriminant(&backend))) {
        return *answer;
    }
    let level = match db
        .query_one_raw(Statement::from_string(backend, query))
        .await
    {
        Ok(Some(row)) => row.try_get_by_index::<String>(0).ok(),
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
    known.insert((id, discriminant(&backend)), answer);
    answer
}
