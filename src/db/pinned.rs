//! A PostgreSQL connection taken out of the pool for one write in two flights
//! (`write/flights.rs`), and the messages sent on it.
//!
//! Why freshlock holds the connection itself: a write's transaction in sea-orm waits for the
//! reply of its `BEGIN` (sqlx's transaction manager reads it before anything else is sent) and
//! sends its `COMMIT` alone, so a locked write there is four round trips at least. sqlx cannot
//! pipeline prepared statements either. What it can send is a *simple query* of several
//! statements, which the server runs in order and answers at once: `BEGIN; SELECT … FOR UPDATE`
//! is one round trip, `UPDATE … RETURNING …; COMMIT` another. A simple query takes no
//! parameters, so its values are written into the text (`inline/postgres.rs`: only values
//! that read back as their bound form), and its rows come back as text, which sqlx decodes for
//! the types sea-orm reads (a [`QueryResult`] of the row, as from sea-orm's own queries).
//!
//! The server stops a simple query at its first failing statement: a `COMMIT` after a failed
//! `UPDATE` in the same message never runs, and the transaction stays open and aborted. So an
//! error on this connection always ends it here: [`Pinned::discard`] closes it (nothing is
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
    ConnAcquireErr, ConnectionTrait, DbBackend, DbErr, ExecResult, QueryResult, RuntimeErr,
    Statement, Values,
    sqlx::{self, Either, PgConnection, Postgres, pool::PoolConnection, postgres::PgRow},
};
use sea_query_sqlx::SqlxValues;
use tokio::sync::Mutex;

/// What one statement of a message answered: its rows, and how many rows it changed.
#[derive(Debug, Default)]
pub(crate) struct Reply {
    /// The rows it returned.
    pub(crate) rows: Vec<PgRow>,
    /// The rows it inserted, updated or deleted.
    pub(crate) affected: u64,
}

/// A connection of the pool held for one write (see the module docs). Dropped, it goes back to
/// the pool; [`discard`](Self::discard) closes it instead, after any failure.
#[derive(Debug)]
pub(crate) struct Pinned {
    conn: Mutex<PoolConnection<Postgres>>,
    /// Statements sent through [`ConnectionTrait`] (the entity's hooks, the evidence's reads).
    sent: AtomicU32,
    /// Behind a transaction pooler: the hooks' statements are not kept prepared.
    pooled: bool,
}

impl Pinned {
    /// A connection of `pool`'s (`pooled`: behind a transaction pooler).
    pub(crate) async fn acquire(pool: &sqlx::PgPool, pooled: bool) -> Result<Self, DbErr> {
        let conn = pool.acquire().await.map_err(|e| match e {
            sqlx::Error::PoolTimedOut => DbErr::ConnectionAcquire(ConnAcquireErr::Timeout),
            sqlx::Error::PoolClosed => DbErr::ConnectionAcquire(ConnAcquireErr::ConnectionClosed),
            e => sqlx_error_to_conn_err(e),
        })?;
        Ok(Self {
            conn: Mutex::new(conn),
            sent: AtomicU32::new(0),
            pooled,
        })
    }

    /// Sends `text` (statements separated by `;`, values written in) as one simple query: one
    /// round trip. The replies of its statements, in order.
    ///
    /// # Errors
    /// The first failing statement's error (the rest of the message did not run), or the
    /// connection's.
    pub(crate) async fn flight(&self, text: String) -> Result<Vec<Reply>, DbErr> {
        let mut conn = self.conn.lock().await;
        let conn: &mut PgConnection = &mut conn;
        let mut replies = Vec::with_capacity(3);
        let mut current = Reply::default();
        let mut stream = sqlx::raw_sql(sqlx::AssertSqlSafe(text)).fetch_many(conn);
        while let Some(item) = stream.try_next().await.map_err(sqlx_error_to_query_err)? {
            match item {
                Either::Right(row) => current.rows.push(row),
                Either::Left(done) => {
                    current.affected = done.rows_affected();
                    replies.push(std::mem::take(&mut current));
                }
            }
        }
        Ok(replies)
    }

    /// How many statements were sent through [`ConnectionTrait`] so far: a write compares the
    /// count before and after its hooks ran.
    pub(crate) fn sent(&self) -> u32 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Closes the connection instead of returning it to the pool: after a failure, or a reply
    /// not read. Sends nothing (a silent peer cannot hold it up); the server ends the session and
    /// rolls back its transaction when it sees the socket closed.
    pub(crate) fn discard(self) {
        drop(self.conn.into_inner().detach());
    }

    /// The hooks' statement, bound, as sea-orm sends it.
    fn query<'q>(&self, stmt: &'q Statement) -> sqlx::query::Query<'q, Postgres, SqlxValues> {
        self.sent.fetch_add(1, Ordering::Relaxed);
        let values = stmt.values.clone().unwrap_or(Values(Vec::new()));
        let query = sqlx::query_with(sqlx::AssertSqlSafe(stmt.sql.as_str()), SqlxValues(values));
        query.persistent(!self.pooled)
    }
}

#[async_trait]
impl ConnectionTrait for Pinned {
    fn get_database_backend(&self) -> DbBackend {
        DbBackend::Postgres
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        let mut conn = self.conn.lock().await;
        let done = self.query(&stmt).execute(&mut **conn).await;
        done.map(ExecResult::from).map_err(sqlx_error_to_exec_err)
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        self.sent.fetch_add(1, Ordering::Relaxed);
        let mut conn = self.conn.lock().await;
        let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut **conn)
            .await;
        done.map(ExecResult::from).map_err(sqlx_error_to_exec_err)
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        let mut conn = self.conn.lock().await;
        let row = self.query(&stmt).fetch_optional(&mut **conn).await;
        row.map(|row| row.map(QueryResult::from))
            .map_err(sqlx_error_to_query_err)
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        let mut conn = self.conn.lock().await;
        let rows = self.query(&stmt).fetch_all(&mut **conn).await;
        rows.map(|rows| rows.into_iter().map(QueryResult::from).collect())
            .map_err(sqlx_error_to_query_err)
    }
}

/// A statement's error, as sea-orm reports a query's (so that `failure.rs` classifies it).
fn sqlx_error_to_query_err(e: sqlx::Error) -> DbErr {
    DbErr::Query(RuntimeErr::SqlxError(e.into()))
}

/// A write's error, as sea-orm reports an execution's.
fn sqlx_error_to_exec_err(e: sqlx::Error) -> DbErr {
    DbErr::Exec(RuntimeErr::SqlxError(e.into()))
}

/// A connection's error, as sea-orm reports one.
fn sqlx_error_to_conn_err(e: sqlx::Error) -> DbErr {
    DbErr::Conn(RuntimeErr::SqlxError(e.into()))
}
