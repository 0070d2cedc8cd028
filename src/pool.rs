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
    let level = match autocommit(db)
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

/// Pools declared to run behind a transaction pooler (PgBouncer in `pool_mode = transaction`),
/// by [`identity`], with a weak handle that tells a live pool from a later one at the same
/// address.
#[cfg(feature = "postgres")]
static POOLED: OnceLock<
    DashMap<usize, std::sync::Weak<sea_orm::sqlx::postgres::PgConnectOptions>>,
> = OnceLock::new();

/// Remembers that `db` runs behind a transaction pooler (see `crate::transaction_pooler`).
#[cfg(feature = "postgres")]
pub(crate) fn mark_transaction_pooled(db: &DatabaseConnection) {
    if let sea_orm::DatabaseConnectionType::SqlxPostgresPoolConnection(_) = &db.inner {
        let options = db.get_postgres_connection_pool().connect_options();
        let id = Arc::as_ptr(&options).cast::<()>() as usize;
        POOLED
            .get_or_init(DashMap::new)
            .insert(id, Arc::downgrade(&options));
    }
}

/// Whether `db` was declared to run behind a transaction pooler: then no statement may run
/// outside an explicit transaction (sqlx prepares and executes in two exchanges, and the pooler
/// may hand the second to another server connection), and freshlock wraps its own
/// single statements in one (see [`Autocommit`]).
pub(crate) fn transaction_pooled(db: &DatabaseConnection) -> bool {
    #[cfg(feature = "postgres")]
    if let sea_orm::DatabaseConnectionType::SqlxPostgresPoolConnection(_) = &db.inner {
        let Some(pooled) = POOLED.get() else {
            return false;
        };
        let options = db.get_postgres_connection_pool().connect_options();
        let id = Arc::as_ptr(&options).cast::<()>() as usize;
        return pooled
            .get(&id)
            .and_then(|weak| weak.upgrade())
            .is_some_and(|known| Arc::ptr_eq(&known, &options));
    }
    let _ = db;
    false
}

/// A statement that freshlock runs outside a transaction of its own (a load, a lease, a commit
/// outcome's resolution), as one autocommit statement — or, on a pool behind a transaction
/// pooler, inside `BEGIN` … `COMMIT` so that its prepare and execute reach one server
/// connection. Either way the statement commits alone, as it would in autocommit.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Autocommit<'a>(pub(crate) &'a DatabaseConnection);

/// [`Autocommit`] on `db`.
pub(crate) fn autocommit(db: &DatabaseConnection) -> Autocommit<'_> {
    Autocommit(db)
}

impl Autocommit<'_> {
    /// Runs `statement` in a transaction of its own; a failed statement rolls it back.
    async fn wrapped<T>(
        &self,
        statement: impl for<'t> FnOnce(
            &'t sea_orm::DatabaseTransaction,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, sea_orm::DbErr>> + Send + 't>,
        >,
    ) -> Result<T, sea_orm::DbErr> {
        // Never cut in half (a caller's deadline may drop this future): see `detach::begin`.
        let txn = crate::detach::begin(self.0, sea_orm::TransactionOptions::default()).await?;
        match statement(&txn).await {
            Ok(value) => {
                txn.commit().await?;
                Ok(value)
            }
            Err(error) => {
                let _ = txn.rollback().await;
                Err(error)
            }
        }
    }
}

#[async_trait::async_trait]
impl ConnectionTrait for Autocommit<'_> {
    fn get_database_backend(&self) -> DbBackend {
        self.0.get_database_backend()
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<sea_orm::ExecResult, sea_orm::DbErr> {
        if !transaction_pooled(self.0) {
            return self.0.execute_raw(stmt).await;
        }
        self.wrapped(move |txn| Box::pin(txn.execute_raw(stmt)))
            .await
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<sea_orm::ExecResult, sea_orm::DbErr> {
        // A simple-protocol statement is one exchange: no wrapping needed.
        self.0.execute_unprepared(sql).await
    }

    async fn query_one_raw(
        &self,
        stmt: Statement,
    ) -> Result<Option<sea_orm::QueryResult>, sea_orm::DbErr> {
        if !transaction_pooled(self.0) {
            return self.0.query_one_raw(stmt).await;
        }
        self.wrapped(move |txn| Box::pin(txn.query_one_raw(stmt)))
            .await
    }

    async fn query_all_raw(
        &self,
        stmt: Statement,
    ) -> Result<Vec<sea_orm::QueryResult>, sea_orm::DbErr> {
        if !transaction_pooled(self.0) {
            return self.0.query_all_raw(stmt).await;
        }
        self.wrapped(move |txn| Box::pin(txn.query_all_raw(stmt)))
            .await
    }

    fn support_returning(&self) -> bool {
        self.0.support_returning()
    }

    fn is_mock_connection(&self) -> bool {
        self.0.is_mock_connection()
    }
}
