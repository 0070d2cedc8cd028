//! A connection taken out of the pool for one write in two flights (`write/flights.rs`), and
//! the messages sent on it: PostgreSQL and MySQL/MariaDB.
//!
//! Why freshlock holds the connection itself: a write's transaction in sea-orm waits for the
//! reply of its `BEGIN` (sqlx's transaction manager reads it before anything else is sent) and
//! sends its `COMMIT` alone, so a locked write there is four round trips at least. sqlx cannot
//! pipeline prepared statements either. What it can send is a message of several statements —
//! a *simple query* on PostgreSQL, a multi-statement `COM_QUERY` on MySQL/MariaDB — which the
//! server runs in order and answers at once: `BEGIN; SELECT … FOR UPDATE` is one round trip,
//! `UPDATE …; COMMIT` another. Such a message takes no parameters, so its values are written
//! into the text (`inline/`: only values that read back as their bound form), and its rows
//! come back as text, which sqlx decodes for the types sea-orm reads (a [`QueryResult`] of the
//! row, as from sea-orm's own queries).
//!
//! The server stops such a message at its first failing statement: a `COMMIT` after a failed
//! `UPDATE` in the same message never runs, and the transaction stays open. So the connection
//! goes back to the pool only when the write says it ended cleanly ([`Pinned::release`]);
//! dropped otherwise — after any failure, a reply not read, a panic — it is closed (nothing is
//! returned to the pool inside a transaction, or with a reply left unread), and the server
//! rolls back what it held.
//!
//! The entity's hooks are handed the connection as a [`ConnectionTrait`] (its statements bound
//! and prepared as sea-orm sends them, one round trip each); [`Pinned::sent`] counts them, for a
//! write whose hooks wrote must then not commit in its UPDATE's message.

use std::sync::atomic::{AtomicU32, Ordering};

use async_trait::async_trait;
use futures_util::TryStreamExt;
use sea_orm::{
    ConnAcquireErr, ConnectionTrait, DatabaseConnection, DbBackend, DbErr, ExecResult, QueryResult,
    RuntimeErr, Statement, Values,
    sqlx::{self, Either, pool::PoolConnection},
};
use sea_query_sqlx::SqlxValues;
use tokio::sync::Mutex;

/// What one statement of a message answered: its rows, and how many rows it changed (on
/// MySQL/MariaDB, found: sqlx asks for found rows).
#[derive(Debug, Default)]
pub(crate) struct Reply {
    /// The rows it returned.
    pub(crate) rows: Vec<QueryResult>,
    /// The rows it inserted, updated or deleted.
    pub(crate) affected: u64,
}

/// A pool's connection, by database.
#[derive(Debug)]
enum Conn {
    #[cfg(feature = "postgres")]
    Postgres(PoolConnection<sqlx::Postgres>),
    #[cfg(feature = "mysql")]
    MySql(PoolConnection<sqlx::MySql>),
}

impl Conn {
    /// Closes the connection without sending anything (a silent peer cannot hold it up).
    fn close(self) {
        match self {
            #[cfg(feature = "postgres")]
            Conn::Postgres(conn) => drop(conn.detach()),
            #[cfg(feature = "mysql")]
            Conn::MySql(conn) => drop(conn.detach()),
        }
    }
}

/// A connection of the pool held for one write (see the module docs). Dropped, it is closed;
/// [`release`](Self::release) gives it back to the pool after a transaction that ended cleanly.
#[derive(Debug)]
pub(crate) struct Pinned {
    /// `None` once released.
    conn: Mutex<Option<Conn>>,
    backend: DbBackend,
    /// Statements sent through [`ConnectionTrait`] (the entity's hooks, the evidence's reads).
    sent: AtomicU32,
    /// Behind a transaction pooler: the hooks' statements are not kept prepared.
    pooled: bool,
}

/// Runs `$body` with `$conn` bound to the raw connection, whichever database it is.
macro_rules! on {
    ($pinned:expr, $conn:ident => $body:expr) => {{
        let mut guard = $pinned.conn.lock().await;
        match guard.as_mut() {
            #[cfg(feature = "postgres")]
            Some(Conn::Postgres(pooled)) => {
                let $conn: &mut sqlx::PgConnection = &mut *pooled;
                $body
            }
            #[cfg(feature = "mysql")]
            Some(Conn::MySql(pooled)) => {
                let $conn: &mut sqlx::MySqlConnection = &mut *pooled;
                $body
            }
            None => Err(DbErr::Custom(
                "the write's connection was given back".into(),
            )),
        }
    }};
}

impl Pinned {
    /// A connection of `db`'s pool (`pooled`: behind a transaction pooler); `None` for a pool
    /// that is neither PostgreSQL nor MySQL/MariaDB.
    pub(crate) async fn acquire(
        db: &DatabaseConnection,
        pooled: bool,
    ) -> Option<Result<Self, DbErr>> {
        use sea_orm::DatabaseConnectionType as Type;
        let acquired = match &db.inner {
            #[cfg(feature = "postgres")]
            Type::SqlxPostgresPoolConnection(_) => {
                let pool = db.get_postgres_connection_pool();
                pool.acquire().await.map(Conn::Postgres)
            }
            #[cfg(feature = "mysql")]
            Type::SqlxMySqlPoolConnection(_) => {
                let pool = db.get_mysql_connection_pool();
                pool.acquire().await.map(Conn::MySql)
            }
            _ => return None,
        };
        let conn = match acquired {
            Ok(conn) => conn,
            Err(sqlx::Error::PoolTimedOut) => {
                return Some(Err(DbErr::ConnectionAcquire(ConnAcquireErr::Timeout)));
            }
            Err(sqlx::Error::PoolClosed) => {
                let closed = ConnAcquireErr::ConnectionClosed;
                return Some(Err(DbErr::ConnectionAcquire(closed)));
            }
            Err(e) => return Some(Err(DbErr::Conn(RuntimeErr::SqlxError(e.into())))),
        };
        let backend = match &conn {
            #[cfg(feature = "postgres")]
            Conn::Postgres(_) => DbBackend::Postgres,
            #[cfg(feature = "mysql")]
            Conn::MySql(_) => DbBackend::MySql,
        };
        Some(Ok(Self {
            conn: Mutex::new(Some(conn)),
            backend,
            sent: AtomicU32::new(0),
            pooled,
        }))
    }

    /// Sends `text` (statements separated by `;`, values written in) as one message: one round
    /// trip. The replies of its statements, in order.
    ///
    /// # Errors
    /// The first failing statement's error (the rest of the message did not run), or the
    /// connection's.
    pub(crate) async fn flight(&self, text: String) -> Result<Vec<Reply>, DbErr> {
        let (replies, failed) = self.flight_until(text).await;
        match failed {
            Some(e) => Err(e),
            None => Ok(replies),
        }
    }

    /// As [`flight`](Self::flight), with the replies of the statements that ran before the
    /// failing one: a message whose `COMMIT` answered before a later statement failed
    /// committed (`jobs/flights/pretake.rs`).
    pub(crate) async fn flight_until(&self, text: String) -> (Vec<Reply>, Option<DbErr>) {
        let text = sqlx::AssertSqlSafe(text);
        let mut replies = Vec::with_capacity(4);
        let failed = on!(self, conn => {
            let mut current = Reply::default();
            let mut stream = sqlx::raw_sql(text).fetch_many(conn);
            loop {
                match stream.try_next().await {
                    Ok(Some(Either::Right(row))) => current.rows.push(QueryResult::from(row)),
                    Ok(Some(Either::Left(done))) => {
                        current.affected = done.rows_affected();
                        replies.push(std::mem::take(&mut current));
                    }
                    Ok(None) => break Ok(()),
                    Err(e) => break Err(query_error(e)),
                }
            }
        })
        .err();
        (replies, failed)
    }

    /// How many statements were sent through [`ConnectionTrait`] so far: a write compares the
    /// count before and after its hooks ran.
    pub(crate) fn sent(&self) -> u32 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Gives the connection back to the pool: only after its transaction ended (`COMMIT` or
    /// `ROLLBACK` answered) and every reply was read.
    pub(crate) fn release(mut self) {
        // Dropping the pool's connection returns it.
        drop(self.conn.get_mut().take());
    }

    /// The values of a hook's statement, bound as sea-orm binds them.
    fn values(&self, stmt: &Statement) -> SqlxValues {
        self.sent.fetch_add(1, Ordering::Relaxed);
        SqlxValues(stmt.values.clone().unwrap_or(Values(Vec::new())))
    }
}

impl Drop for Pinned {
    /// Not released: closed, sending nothing; the server ends the session and rolls back its
    /// transaction when it sees the socket closed.
    fn drop(&mut self) {
        if let Some(conn) = self.conn.get_mut().take() {
            conn.close();
        }
    }
}

#[async_trait]
impl ConnectionTrait for Pinned {
    fn get_database_backend(&self) -> DbBackend {
        self.backend
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        let (values, persistent) = (self.values(&stmt), !self.pooled);
        let sql = sqlx::AssertSqlSafe(stmt.sql.as_str());
        on!(self, conn => {
            let query = sqlx::query_with(sql, values).persistent(persistent);
            query.execute(conn).await.map(ExecResult::from).map_err(exec_error)
        })
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        self.sent.fetch_add(1, Ordering::Relaxed);
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        on!(self, conn => {
            let done = sqlx::raw_sql(sql).execute(conn).await;
            done.map(ExecResult::from).map_err(exec_error)
        })
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        let (values, persistent) = (self.values(&stmt), !self.pooled);
        let sql = sqlx::AssertSqlSafe(stmt.sql.as_str());
        on!(self, conn => {
            let query = sqlx::query_with(sql, values).persistent(persistent);
            let row = query.fetch_optional(conn).await.map_err(query_error)?;
            Ok(row.map(QueryResult::from))
        })
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        let (values, persistent) = (self.values(&stmt), !self.pooled);
        let sql = sqlx::AssertSqlSafe(stmt.sql.as_str());
        on!(self, conn => {
            let query = sqlx::query_with(sql, values).persistent(persistent);
            let rows = query.fetch_all(conn).await.map_err(query_error)?;
            Ok(rows.into_iter().map(QueryResult::from).collect())
        })
    }
}

/// A statement's error, as sea-orm reports a query's (so that `failure.rs` classifies it).
fn query_error(e: sqlx::Error) -> DbErr {
    DbErr::Query(RuntimeErr::SqlxError(e.into()))
}

/// A write's error, as sea-orm reports an execution's.
fn exec_error(e: sqlx::Error) -> DbErr {
    DbErr::Exec(RuntimeErr::SqlxError(e.into()))
}
