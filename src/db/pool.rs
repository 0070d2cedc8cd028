//! What freshlock keeps of a connection pool ([`PoolState`]): whether its transactions already
//! run at READ COMMITTED (then `BEGIN` needs no `SET TRANSACTION`: one round trip less per
//! locked write), whether it runs behind a transaction pooler, and commit combining's rooms; and
//! [`Autocommit`], freshlock's single statements on it.

use std::{
    any::Any,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use tracing::debug;

use crate::registry::Registry;

/// What freshlock keeps of one connection pool, shared by every session and every call on it.
///
/// sea-orm's `DatabaseConnection` has no room for a library's state, so this is found through
/// the process's table of pools ([`state`], a [`Registry`]) by the pool's identity: its connect
/// options, one allocation shared by every clone of the pool and by no other pool.
#[derive(Default)]
pub(crate) struct PoolState {
    /// Whether the pool's transactions run at READ COMMITTED by default, once read.
    read_committed: OnceLock<bool>,
    /// Whether the database has `freshlock_incarnation` (PostgreSQL), once read.
    incarnation_table: OnceLock<bool>,
    /// The server incarnation's token as last seen in `freshlock_incarnation`, and when.
    incarnation: Mutex<Option<(Arc<str>, Instant)>>,
    /// Declared to run behind a transaction pooler (see `crate::db::transaction_pooler`).
    pooled: AtomicBool,
    /// Commit combining's rooms on this pool (see `combine.rs`), made on first use.
    pub(crate) rooms: OnceLock<Arc<dyn Any + Send + Sync>>,
}

/// The connect options of `db`'s pool: its identity. `None` for a connection that is not a sqlx
/// pool (a mock).
fn options(db: &DatabaseConnection) -> Option<Arc<dyn Any + Send + Sync>> {
    use sea_orm::DatabaseConnectionType as Type;
    match &db.inner {
        #[cfg(feature = "sqlite")]
        Type::SqlxSqlitePoolConnection(_) => {
            Some(db.get_sqlite_connection_pool().connect_options())
        }
        #[cfg(feature = "postgres")]
        Type::SqlxPostgresPoolConnection(_) => {
            Some(db.get_postgres_connection_pool().connect_options())
        }
        #[cfg(feature = "mysql")]
        Type::SqlxMySqlPoolConnection(_) => Some(db.get_mysql_connection_pool().connect_options()),
        _ => None,
    }
}

/// The state of `db`'s pool (made on first use); `None` for a connection that is not a sqlx
/// pool (a mock), which then has none: its writes are never combined, and it is never taken to
/// be behind a pooler.
pub(crate) fn state(db: &DatabaseConnection) -> Option<Arc<PoolState>> {
    static POOLS: Registry<dyn Any + Send + Sync, Arc<PoolState>> = Registry::new();
    Some(POOLS.get_or_insert_with(&options(db)?, Arc::default))
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
    let backend = db.get_database_backend();
    // MariaDB before 11.1 names the variable `tx_isolation`, MySQL 8 only
    // `transaction_isolation`: `SHOW VARIABLES` finds whichever the server has (both hold the
    // session's level), where selecting the other name would fail on every `BEGIN`.
    let (query, column) = match backend {
        DbBackend::Postgres => ("SHOW default_transaction_isolation", 0),
        DbBackend::MySql => (
            "SHOW SESSION VARIABLES WHERE Variable_name IN ('tx_isolation', 'transaction_isolation')",
            1,
        ),
        _ => return false,
    };
    let Some(state) = state(db) else {
        return false;
    };
    if let Some(answer) = state.read_committed.get() {
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
    *state.read_committed.get_or_init(|| answer)
}

/// Makes every connection of the MySQL/MariaDB pool that `options` connects run its
/// transactions at READ COMMITTED by default: `SET SESSION TRANSACTION ISOLATION LEVEL READ
/// COMMITTED` as each connection is made (sqlx's `after_connect`, through
/// [`ConnectOptions::map_sqlx_mysql_pool_opts`](sea_orm::ConnectOptions::map_sqlx_mysql_pool_opts),
/// which replaces a mapping set before it; set yours first and call this last, or make your
/// own mapping run the same statement).
///
/// freshlock's transactions run at READ COMMITTED, which MySQL and MariaDB do not default to
/// (REPEATABLE READ): on such a pool each `BEGIN` needs a `SET TRANSACTION` before it, a round
/// trip of its own. On a pool whose connections default to it already — read once per pool —
/// that statement is skipped: a `locked_update` under `local` sends six statements instead of
/// seven (`tests/round_trips.rs`; see `BENCHMARKS.md` for what that is worth).
///
/// The application's own transactions on the pool run at READ COMMITTED too (as Django's do on
/// MySQL by default): reads within one of them see what other transactions committed since,
/// and no gap locks are taken. Setting `transaction_isolation` in the server's configuration
/// does the same for every client.
///
/// ```no_run
/// # async fn connect() -> Result<(), sea_orm::DbErr> {
/// let mut options = sea_orm::ConnectOptions::new("mysql://root@127.0.0.1:3306/test");
/// freshlock::mysql_read_committed(&mut options);
/// let db = sea_orm::Database::connect(options).await?;
/// # let _ = db;
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "mysql")]
pub fn mysql_read_committed(options: &mut sea_orm::ConnectOptions) -> &mut sea_orm::ConnectOptions {
    const SET: &str = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";
    options.map_sqlx_mysql_pool_opts(|pool| {
        pool.after_connect(|conn, _| {
            Box::pin(async move {
                sea_orm::sqlx::Executor::execute(conn, SET)
                    .await
                    .map(|_| ())
            })
        })
    })
}

/// How long a seen incarnation token is used without looking again: a write within this of the
/// last look returns only its transaction id; the first one after it also reads the token (see
/// [`incarnation`]).
pub(crate) const INCARNATION_FRESH: Duration = Duration::from_secs(1);

/// What a PostgreSQL write on a pool knows of the server's incarnation (see `commit.rs`).
#[derive(Debug)]
pub(crate) enum Incarnation {
    /// Not PostgreSQL, no `freshlock_incarnation` table, or not a sqlx pool: commit markers.
    Unsupported,
    /// The token was seen within [`INCARNATION_FRESH`]: the write need not read it.
    Known(Arc<str>),
    /// Not seen lately: the write reads it in its own statement.
    Unseen,
}

/// What `db`'s pool knows of the server incarnation (see [`Incarnation`]). `on` is where to
/// ask the first time: the write's own transaction, never another connection of the pool (a
/// pool whose every connection is in a write that waits for one more would wait for good).
///
/// Whether the database has `freshlock_incarnation` ([`crate::schema::IncarnationMigration`])
/// is read once per pool: `Unsupported` while the database cannot be asked (asked again next
/// time), and for good when the table is missing — such a pool keeps writing commit markers
/// until the process restarts, so run the migrations before the first write.
///
/// Why a token seen earlier (not in the write's own transaction) is evidence enough: the
/// write's transaction id is given out after the token was seen, so after its row was
/// created. While the row is still there no crash recovery has happened since (it would have
/// emptied the table; tokens are never used again), so neither since the id was given out:
/// `txid_status` speaks of this write. A token gone stale by a crash only keeps a resolution
/// from trusting `committed`; the stale token is forgotten then ([`forget_incarnation`]), and
/// within [`INCARNATION_FRESH`] anyway.
pub(crate) async fn incarnation(db: &DatabaseConnection, on: &impl ConnectionTrait) -> Incarnation {
    let backend = db.get_database_backend();
    if backend != DbBackend::Postgres {
        return Incarnation::Unsupported;
    }
    let Some(state) = state(db) else {
        return Incarnation::Unsupported;
    };
    if !has_incarnation_table(on, &state).await {
        return Incarnation::Unsupported;
    }
    let seen = state
        .incarnation
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match &*seen {
        Some((token, at)) if at.elapsed() < INCARNATION_FRESH => {
            Incarnation::Known(Arc::clone(token))
        }
        _ => Incarnation::Unseen,
    }
}

/// Remembers that `token` is the server incarnation now (read from `freshlock_incarnation`).
pub(crate) fn saw_incarnation(db: &DatabaseConnection, token: &str) {
    if let Some(state) = state(db) {
        let mut seen = state
            .incarnation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &mut *seen {
            Some((known, at)) if **known == *token => *at = Instant::now(),
            _ => *seen = Some((Arc::from(token), Instant::now())),
        }
    }
}

/// Forgets the incarnation token: it was found gone (the server recovered from a crash).
pub(crate) fn forget_incarnation(db: &DatabaseConnection) {
    if let Some(state) = state(db) {
        *state
            .incarnation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// Whether the database (PostgreSQL, whose pool's state is `state`) has `freshlock_incarnation`:
/// asked on `on` once per pool.
async fn has_incarnation_table(on: &impl ConnectionTrait, state: &PoolState) -> bool {
    if let Some(answer) = state.incarnation_table.get() {
        return *answer;
    }
    let query = format!(
        "SELECT to_regclass('{}') IS NOT NULL AS present",
        crate::schema::INCARNATION_TABLE
    );
    let answer = match on
        .query_one_raw(Statement::from_string(DbBackend::Postgres, query))
        .await
    {
        Ok(row) => row.is_some_and(|row| row.try_get::<bool>("", "present").unwrap_or(false)),
        Err(error) => {
            debug!(%error, "looking for freshlock_incarnation failed; writing commit markers");
            return false;
        }
    };
    if !answer {
        tracing::warn!(
            "freshlock_incarnation is missing (freshlock::schema::IncarnationMigration): \
             locked writes on this pool write commit markers, which cost more"
        );
    }
    *state.incarnation_table.get_or_init(|| answer)
}

/// Whether any pool of this process was declared to run behind a transaction pooler: until one
/// is, no statement looks up its pool's state for it.
static ANY_POOLED: AtomicBool = AtomicBool::new(false);

/// Remembers that `db` runs behind a transaction pooler (see `crate::db::transaction_pooler`).
#[cfg(feature = "postgres")]
pub(crate) fn mark_transaction_pooled(db: &DatabaseConnection) {
    if let (sea_orm::DatabaseConnectionType::SqlxPostgresPoolConnection(_), Some(state)) =
        (&db.inner, state(db))
    {
        state.pooled.store(true, Ordering::SeqCst);
        ANY_POOLED.store(true, Ordering::SeqCst);
    }
}

/// Whether `db` was declared to run behind a transaction pooler: then no statement may run
/// outside an explicit transaction (sqlx prepares and executes in two exchanges, and the pooler
/// may hand the second to another server connection), and freshlock wraps its own
/// single statements in one (see [`Autocommit`]).
pub(crate) fn transaction_pooled(db: &DatabaseConnection) -> bool {
    ANY_POOLED.load(Ordering::Relaxed)
        && state(db).is_some_and(|state| state.pooled.load(Ordering::SeqCst))
}

/// A statement that freshlock runs outside a transaction of its own (a load, a lease, a commit
/// outcome's resolution), as one autocommit statement — or, on a pool behind a transaction
/// pooler, inside `BEGIN` … `COMMIT` so that its prepare and execute reach one server
/// connection. Either way the statement commits alone, as it would in autocommit.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Autocommit<'a>(pub(crate) &'a DatabaseConnection);

/// Runs `stmt`, an `UPDATE` or `DELETE` of freshlock's upkeep that finds its rows among many
/// (the job sweep, lease reclaim and prune; the commit-marker sweep off MySQL), alone on `db`: how many
/// rows it changed. One autocommit statement ([`Autocommit`]), except on MySQL/MariaDB: there it
/// runs in a transaction of its own at READ COMMITTED, which takes no gap locks, unlocks each row
/// it reads and does not change, and (in an `UPDATE`) passes over a locked row whose committed
/// version does not match. Under the server's default REPEATABLE READ a statement that scans
/// keeps every row it read locked, and the gaps between them, while it waits for a locked row —
/// a running job's, a write's marker not yet committed — and meanwhile takes skip the rows it
/// holds and inserts wait (CI's MariaDB demo stopped with jobs left: `jobs::store::sweep`).
pub(crate) async fn upkeep(
    db: &DatabaseConnection,
    stmt: Statement,
) -> Result<u64, sea_orm::DbErr> {
    if db.get_database_backend() != DbBackend::MySql {
        let done = autocommit(db).execute_raw(stmt).await?;
        return Ok(done.rows_affected());
    }
    alone(db, read_committed(), |txn| {
        Box::pin(async move { Ok(txn.execute_raw(stmt).await?.rows_affected()) })
    })
    .await
}

/// A transaction's options for READ COMMITTED.
pub(crate) fn read_committed() -> sea_orm::TransactionOptions {
    sea_orm::TransactionOptions {
        isolation_level: Some(sea_orm::IsolationLevel::ReadCommitted),
        ..sea_orm::TransactionOptions::default()
    }
}

/// The work of a transaction of its own ([`alone`]).
pub(crate) type Alone<'t, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, sea_orm::DbErr>> + Send + 't>>;

/// Runs `work` in a transaction of its own on `db`, begun with `options`: committed when `work`
/// succeeds, rolled back when it fails.
pub(crate) async fn alone<T>(
    db: &DatabaseConnection,
    options: sea_orm::TransactionOptions,
    work: impl for<'t> FnOnce(&'t sea_orm::DatabaseTransaction) -> Alone<'t, T>,
) -> Result<T, sea_orm::DbErr> {
    // Never cut in half (a caller's deadline may drop this future): see `detach::begin`.
    let txn = crate::db::detach::begin(db, options).await?;
    match work(&txn).await {
        Ok(value) => txn.commit().await.map(|()| value),
        Err(error) => {
            let _ = txn.rollback().await;
            Err(error)
        }
    }
}

/// [`Autocommit`] on `db`.
pub(crate) fn autocommit(db: &DatabaseConnection) -> Autocommit<'_> {
    Autocommit(db)
}

impl Autocommit<'_> {
    /// Runs `statement` in a transaction of its own; a failed statement rolls it back.
    async fn wrapped<T>(
        &self,
        statement: impl for<'t> FnOnce(&'t sea_orm::DatabaseTransaction) -> Alone<'t, T>,
    ) -> Result<T, sea_orm::DbErr> {
        alone(self.0, sea_orm::TransactionOptions::default(), statement).await
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
