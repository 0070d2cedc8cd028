//! A transaction on a held connection ([`Pinned`]) whose `BEGIN` rides in the message of its
//! first statement, and whose `COMMIT` rides in the message of its last: a keyed job's attempt
//! in as few round trips as its handler allows (`jobs/flights.rs`).
//!
//! The first query sent through it (a job's take) goes as one text message, `BEGIN`, the query
//! with its values written in (`inline/`), and the statements the transaction asked to read
//! with it (the commit's evidence: the transaction's id); when a value cannot be written in,
//! `BEGIN` and those statements go first and the query after, bound. Every later statement is
//! sent bound and prepared, as sea-orm sends it (a handler's). Its owner sends the last
//! statements and `COMMIT` as one message on [`Held::conn`], each written by
//! [`Held::executed`]: on PostgreSQL, `EXECUTE` of a statement prepared on the connection
//! under a name of its text (its `PREPARE` in the same message the first time; the names the
//! connection has are read with `BEGIN`), so that the server plans it once per connection
//! instead of on every message. A first query whose `EXECUTE` finds no such statement (the
//! names are not read yet) is sent again after its `PREPARE`: one round trip, once per
//! connection and statement.
//!
//! Why, and what happens after a failure: see `pinned.rs` — the connection is closed unless the
//! transaction ended cleanly, and the server rolls back what it held.

use std::{
    collections::HashSet,
    hash::{Hash, Hasher},
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
};

use async_trait::async_trait;
use sea_orm::{ConnectionTrait, DbBackend, DbErr, ExecResult, QueryResult, Statement};

use super::{
    failure::is_missing_prepared,
    inline::statement_text,
    pinned::{Pinned, Reply},
};

/// The statement `BEGIN`'s message ends with on a connection that prepares: the names of
/// freshlock's statements prepared on it.
const PREPARED: &str = "SELECT array_to_string(ARRAY(SELECT name FROM pg_prepared_statements \
     WHERE name LIKE 'freshlock\\_%'), ' ') AS freshlock_prepared";

/// A transaction on a held connection (see the module docs).
#[derive(Debug)]
pub(crate) struct Held {
    conn: Pinned,
    /// The text that begins the transaction (`begin.rs`'s `text`).
    begin: &'static str,
    /// Whether `BEGIN` was sent.
    begun: AtomicBool,
    /// Statements sent in `BEGIN`'s message, after the first query (`;`-separated).
    with_begin: Option<String>,
    /// Their replies, once sent.
    read_with_begin: Mutex<Vec<Reply>>,
    /// Whether freshlock's own statements go as `EXECUTE` of statements prepared on the
    /// connection by name (see [`Held::executed`]).
    prepares: bool,
    /// The names prepared on the connection: read with `BEGIN`, and those its messages
    /// prepare.
    prepared: Mutex<HashSet<String>>,
}

/// A statement as a message sends it: its text, and the `PREPARE` to send before it when it
/// runs as `EXECUTE` of a statement the connection does not have yet.
pub(crate) struct Text {
    /// `PREPARE name AS …`, when it is to be sent first.
    pub(crate) prepare: Option<String>,
    /// The statement, or `EXECUTE name(…)`, its values written in.
    pub(crate) text: String,
}

impl Text {
    /// The statements to send, in order.
    pub(crate) fn statements(self) -> Vec<String> {
        self.prepare.into_iter().chain([self.text]).collect()
    }
}

impl Held {
    /// A transaction on `conn`, begun by `begin` (not yet sent); `with_begin`: statements
    /// (values written in) to send in `BEGIN`'s message, whose replies
    /// [`read_with_begin`](Self::read_with_begin) gives. `prepares`: freshlock's statements
    /// go as `EXECUTE` of statements prepared on the connection (PostgreSQL, not behind a
    /// transaction pooler, which would run them on other server connections).
    pub(crate) fn new(
        conn: Pinned,
        begin: &'static str,
        with_begin: Option<String>,
        prepares: bool,
    ) -> Self {
        Self {
            conn,
            begin,
            begun: AtomicBool::new(false),
            with_begin,
            read_with_begin: Mutex::default(),
            prepares,
            prepared: Mutex::default(),
        }
    }

    /// Whether `BEGIN` was sent (a statement ran in the transaction).
    pub(crate) fn begun(&self) -> bool {
        self.begun.load(Ordering::SeqCst)
    }

    /// The replies of the statements sent with `BEGIN` (empty before it was sent).
    pub(crate) fn read_with_begin(&self) -> Vec<Reply> {
        std::mem::take(
            &mut self
                .read_with_begin
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// The held connection, to send messages of its own on (the transaction's last).
    pub(crate) fn conn(&self) -> &Pinned {
        &self.conn
    }

    /// Gives the connection back to the pool: only after the transaction ended cleanly (or was
    /// never begun).
    pub(crate) fn release(self) {
        self.conn.release();
    }

    /// `stmt` as a message sends it, its values written in, or `None` when one cannot be.
    ///
    /// On a connection that prepares, `EXECUTE` of the statement prepared under a name of its
    /// text (`freshlock_…`), preceded by its `PREPARE` when the connection does not have it:
    /// the server then plans it once per connection, not on every message — the completion of
    /// a job took 0.63 ms to plan, `freshlock_job` having many indexes, and 0.05 ms to run.
    pub(crate) fn executed(&self, stmt: &Statement) -> Option<Text> {
        let text = statement_text(stmt)?;
        if !self.prepares {
            return Some(Text {
                prepare: None,
                text,
            });
        }
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        stmt.sql.hash(&mut hasher);
        let name = format!("freshlock_{:016x}", hasher.finish());
        let values = (stmt.values.as_ref()).map_or(&[][..], |values| &values.0[..]);
        let arguments = (1..=values.len())
            .map(|n| format!("${n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let execute = match values.is_empty() {
            true => format!("EXECUTE {name}"),
            false => format!("EXECUTE {name}({arguments})"),
        };
        let text = statement_text(&Statement {
            sql: execute,
            ..stmt.clone()
        })?;
        let mut prepared = self.prepared.lock().unwrap_or_else(PoisonError::into_inner);
        let prepare = prepared
            .insert(name.clone())
            .then(|| format!("PREPARE {name} AS {}", stmt.sql));
        Some(Text { prepare, text })
    }

    /// Sends `BEGIN` (with `query`, when given) and the statements asked for with it, as one
    /// message: `query`'s reply, when it was sent. A query that runs as `EXECUTE` of a
    /// statement the connection turns out not to have is sent again after its `PREPARE`
    /// (once per connection and statement).
    async fn begin(&self, query: Option<Text>) -> Result<Option<Reply>, DbErr> {
        self.begun.store(true, Ordering::SeqCst);
        let sent = self.send_begin(query.as_ref(), false).await;
        match sent {
            Err(e)
                if is_missing_prepared(&e)
                    && query.as_ref().is_some_and(|q| q.prepare.is_some()) =>
            {
                self.send_begin(query.as_ref(), true).await
            }
            sent => sent,
        }
    }

    /// [`begin`](Self::begin)'s message; `again`: after a first one stopped at the query's
    /// `EXECUTE` (`ROLLBACK` first, then its `PREPARE`). The names prepared on the connection
    /// are read at its end.
    async fn send_begin(&self, query: Option<&Text>, again: bool) -> Result<Option<Reply>, DbErr> {
        let mut statements: Vec<&str> = Vec::with_capacity(6);
        if again {
            statements.push("ROLLBACK");
            if let Some(prepare) = query.and_then(|query| query.prepare.as_deref()) {
                statements.push(prepare);
            }
        }
        let skip = statements.len() + self.begin.split(';').count();
        statements.push(self.begin);
        if let Some(query) = query {
            statements.push(&query.text);
        }
        if let Some(with_begin) = &self.with_begin {
            statements.push(with_begin);
        }
        if self.prepares {
            statements.push(PREPARED);
        }
        let mut replies = self.conn.flight(statements.join("; ")).await?.into_iter();
        // `ROLLBACK`'s and `PREPARE`'s replies, `BEGIN`'s own (and `SET TRANSACTION`'s), then
        // the query's.
        for _ in 0..skip {
            replies.next();
        }
        let first = match query {
            Some(_) => Some(replies.next().ok_or_else(short)?),
            None => None,
        };
        let mut rest: Vec<Reply> = replies.collect();
        if self.prepares {
            let names = rest.pop().ok_or_else(short)?;
            let names = names
                .rows
                .first()
                .map(|row| row.try_get::<String>("", "freshlock_prepared"));
            let names = names.transpose()?.unwrap_or_default();
            *self.prepared.lock().unwrap_or_else(PoisonError::into_inner) =
                names.split_whitespace().map(str::to_owned).collect();
        }
        *self
            .read_with_begin
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = rest;
        Ok(first)
    }

    /// The rows of `stmt` when it is the transaction's first statement and its values could be
    /// written in (sent with `BEGIN`); `None` when it is to be sent bound (`BEGIN` was sent
    /// first when it was not yet).
    async fn first(&self, stmt: &Statement) -> Result<Option<Vec<QueryResult>>, DbErr> {
        if self.begun() {
            return Ok(None);
        }
        let text = self.executed(stmt);
        let written = text.is_some();
        let reply = self.begin(text).await?;
        Ok(reply.filter(|_| written).map(|reply| reply.rows))
    }

    /// Sends `BEGIN` when the transaction was not begun yet.
    async fn begun_before(&self) -> Result<(), DbErr> {
        if !self.begun() {
            self.begin(None).await?;
        }
        Ok(())
    }
}

/// A message that answered fewer statements than it sent (the server stops at a failing one,
/// whose error the message reports instead).
fn short() -> DbErr {
    DbErr::Custom("a message's reply answered fewer statements than it sent".into())
}

#[async_trait]
impl ConnectionTrait for Held {
    fn get_database_backend(&self) -> DbBackend {
        self.conn.get_database_backend()
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        self.begun_before().await?;
        self.conn.execute_raw(stmt).await
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        self.begun_before().await?;
        self.conn.execute_unprepared(sql).await
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        match self.first(&stmt).await? {
            Some(rows) => Ok(rows.into_iter().next()),
            None => self.conn.query_one_raw(stmt).await,
        }
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        match self.first(&stmt).await? {
            Some(rows) => Ok(rows),
            None => self.conn.query_all_raw(stmt).await,
        }
    }
}
