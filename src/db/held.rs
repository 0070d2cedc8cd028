//! A transaction on a held connection ([`Pinned`]) whose `BEGIN` rides in the message of its
//! first statement, and whose `COMMIT` rides in the message of its last: a keyed job's attempt
//! in as few round trips as its handler allows (`jobs/flights/`).
//!
//! The first query sent through it (a job's take) goes as one text message, `BEGIN`, the query
//! with its values written in (`inline/`), and the statements the transaction asked to read
//! with it (the commit's evidence: the transaction's id); when a value cannot be written in,
//! `BEGIN` and those statements go first and the query after, bound. Every later statement is
//! sent bound and prepared, as sea-orm sends it (a handler's). Its owner sends the last
//! statements and `COMMIT` as one message on [`Held::conn`], each written by
//! [`Held::executed`] (`prepared/`: on PostgreSQL, `EXECUTE` of statements the connection
//! prepared, planned once per connection). That message may go on after its `COMMIT` with the
//! next transaction's `BEGIN` and first query ([`Held::carry`], `jobs/flights/pretake.rs`).
//!
//! Why, and what happens after a failure: see `pinned.rs` — the connection is closed unless the
//! transaction ended cleanly, and the server rolls back what it held.

use std::sync::{
    Arc, Mutex, PoisonError,
    atomic::{AtomicBool, Ordering},
};

use async_trait::async_trait;
use sea_orm::{ConnectionTrait, DbBackend, DbErr, ExecResult, QueryResult, Statement};

use super::{
    failure::is_missing_prepared,
    inline::statement_text,
    pinned::{Pinned, Reply},
    prepared::{Known, Prepared, Text},
};

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
    /// freshlock's statements prepared on the connection.
    prepared: Prepared,
    /// Statements (values written in, one each) to send in the transaction's last message,
    /// before the owner's own ([`ride`](Self::ride)).
    riders: Mutex<Vec<String>>,
    /// A transaction begun in the previous one's last message, after its `COMMIT`: the text of
    /// the query sent there and its rows, for the first query that sends the same
    /// ([`carry`](Self::carry)).
    sent_ahead: Mutex<Option<(String, Vec<QueryResult>)>>,
}

impl Held {
    /// A transaction on `conn`, begun by `begin` (not yet sent); `with_begin`: statements
    /// (values written in) to send in `BEGIN`'s message, whose replies
    /// [`read_with_begin`](Self::read_with_begin) gives. With `prepares` (the pool's), freshlock's
    /// statements go as `EXECUTE` of statements prepared on the connection (PostgreSQL, not
    /// behind a transaction pooler, which would run them on other server connections).
    pub(crate) fn new(
        conn: Pinned,
        begin: &'static str,
        with_begin: Option<String>,
        prepares: Option<Arc<Known>>,
    ) -> Self {
        Self {
            conn,
            begin,
            begun: AtomicBool::new(false),
            with_begin,
            read_with_begin: Mutex::default(),
            prepared: Prepared::new(prepares),
            riders: Mutex::default(),
            sent_ahead: Mutex::default(),
        }
    }

    /// Whether a transaction can begin in this one's last message, after its `COMMIT`: this
    /// one was begun, and so knows what a first message reads — the names the connection has
    /// prepared (read with `BEGIN`, and those this transaction prepared: the last message
    /// sends them all) — so the next one's `BEGIN`, its first query and the statements read
    /// with it ride after the `COMMIT` ([`begin_ahead`](Self::begin_ahead)).
    pub(crate) fn carries(&self) -> bool {
        self.begun() && self.prepared.names_read()
    }

    /// The statements that begin the next transaction on this connection with `first` as its
    /// first query, for this one's last message to send after its `COMMIT`
    /// ([`carries`](Self::carries)): the text that begins it, `first` as a message sends it
    /// (by name on PostgreSQL, its `PREPARE` before it when the connection lacks it), and
    /// `with_begin`, the statement the next transaction asks to read with `BEGIN` (the
    /// evidence's transaction id, as [`new`](Self::new)'s) — one each, with the index of
    /// `first`'s reply among theirs. `None` when `first`'s values cannot be written in.
    pub(crate) fn begin_ahead(
        &self,
        first: &Statement,
        with_begin: Option<String>,
    ) -> Option<(Vec<String>, usize)> {
        let begin = self.begin.split(';').map(|statement| statement.trim());
        let mut statements: Vec<String> = begin.map(str::to_owned).collect();
        statements.extend(self.executed(first)?.statements());
        let at = statements.len() - 1;
        statements.extend(with_begin);
        Some((statements, at))
    }

    /// The next transaction on this connection, begun in this one's last message after its
    /// `COMMIT` ([`begin_ahead`](Self::begin_ahead)) with query `text`, whose reply is
    /// `replies[at]` (only once the `COMMIT` and every statement after it answered; those
    /// after `at` are what was read with `BEGIN`): its first statement, when it is a query
    /// that sends the same text, gets the rows without a round trip; any other statement (and
    /// any after the first) goes as in a begun transaction. The connection's prepared names
    /// go on with it.
    pub(crate) fn carry(self, text: String, mut replies: Vec<Reply>, at: usize) -> Self {
        let with_begin = replies.split_off((at + 1).min(replies.len()));
        let rows = replies.pop().map(|reply| reply.rows).unwrap_or_default();
        Self {
            conn: self.conn,
            begin: self.begin,
            begun: AtomicBool::new(true),
            with_begin: None,
            read_with_begin: Mutex::new(with_begin),
            prepared: self.prepared,
            riders: Mutex::default(),
            sent_ahead: Mutex::new(Some((text, rows))),
        }
    }

    /// Whether `BEGIN` was sent (a statement ran in the transaction).
    pub(crate) fn begun(&self) -> bool {
        self.begun.load(Ordering::SeqCst)
    }

    /// Whether its statements go by name ([`executed`](Self::executed)) and the transaction
    /// was not begun: the names the connection has are read with `BEGIN`, and until then a
    /// statement would be prepared again.
    pub(crate) fn names_unread(&self) -> bool {
        !self.begun() && self.prepared.by_name()
    }

    /// The text that begins the transaction when it was not begun yet, for its owner to send
    /// first in a message of its own (the transaction counts as begun from here).
    pub(crate) fn unbegun(&self) -> Option<&'static str> {
        (!self.begun.swap(true, Ordering::SeqCst)).then_some(self.begin)
    }

    /// Leaves `stmt` to be sent in the transaction's last message, before its `COMMIT`, for a
    /// statement whose reply nobody reads: `false` when its values cannot be written in (the
    /// caller sends it itself).
    pub(crate) fn ride(&self, stmt: &Statement) -> bool {
        let Some(text) = self.executed(stmt) else {
            return false;
        };
        (self.riders.lock().unwrap_or_else(PoisonError::into_inner)).extend(text.statements());
        true
    }

    /// The statements left to ride in the last message ([`ride`](Self::ride)), one each.
    pub(crate) fn riders(&self) -> Vec<String> {
        std::mem::take(&mut self.riders.lock().unwrap_or_else(PoisonError::into_inner))
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

    /// `stmt` as a message sends it, its values written in, or `None` when one cannot be
    /// (`prepared/`).
    pub(crate) fn executed(&self, stmt: &Statement) -> Option<Text> {
        self.prepared.text(stmt)
    }

    /// `stmt` as the transaction's only message sends it, when nothing was sent before it
    /// ([`names_unread`](Self::names_unread)): by name, assuming the connection has it
    /// ([`Prepared::assumed`]; [`last`](Self::last) sends it again when it has not).
    pub(crate) fn assumed(&self, stmt: &Statement) -> Option<Text> {
        self.prepared.assumed(stmt)
    }

    /// Sends `statements`, the transaction's last message, whose first `committed` replies
    /// end with its `COMMIT`'s. A statement after the `COMMIT` that fails leaves it committed:
    /// the replies read are returned, fewer than the statements (the connection is then in a
    /// transaction that failed, and must be closed). When it stopped before, at a statement
    /// [`assumed`](Self::assumed) to be prepared that the connection does not have (SQLSTATE
    /// 26000), nothing of it was committed — the server stopped before its `COMMIT` — and it
    /// goes again after `ROLLBACK` and the `PREPARE`s it lacks: two round trips more, once per
    /// connection and statement.
    pub(crate) async fn last(
        &self,
        statements: &[String],
        committed: usize,
    ) -> Result<Vec<Reply>, DbErr> {
        let text = statements.join("; ");
        let e = match self.conn.flight_until(text.clone()).await {
            (replies, None) => return Ok(replies),
            (replies, Some(_)) if replies.len() >= committed => return Ok(replies),
            (_, Some(e)) if is_missing_prepared(&e) => e,
            (_, Some(e)) => return Err(e),
        };
        match self.prepared.missing(&self.conn).await? {
            Some(missing) if !missing.is_empty() => {
                let skip = missing.len();
                let again = missing.into_iter().chain([text]).collect::<Vec<_>>();
                let mut replies = self.conn.flight(again.join("; ")).await?;
                replies.drain(..skip.min(replies.len()));
                Ok(replies)
            }
            // Not an assumed statement's: the message's own error.
            _ => Err(e),
        }
    }

    /// Sends `BEGIN` (with `query`, when given) and the statements asked for with it, as one
    /// message: `query`'s reply, when it was sent.
    async fn begin(&self, query: Option<Text>) -> Result<Option<Reply>, DbErr> {
        self.begun.store(true, Ordering::SeqCst);
        let with = self.with_begin.as_deref();
        let (first, rest) = (self.prepared)
            .begin(&self.conn, self.begin, query.as_ref(), with)
            .await?;
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
            return Ok(self.answered_ahead(stmt));
        }
        let text = self.executed(stmt);
        let written = text.is_some();
        let reply = self.begin(text).await?;
        Ok(reply.filter(|_| written).map(|reply| reply.rows))
    }

    /// The rows of `stmt` when it is the transaction's first query and sends what was sent
    /// ahead of the transaction ([`carry`](Self::carry)): `None` otherwise (it goes on its own).
    fn answered_ahead(&self, stmt: &Statement) -> Option<Vec<QueryResult>> {
        let mut ahead = self
            .sent_ahead
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (text, rows) = ahead.take()?;
        (statement_text(stmt).as_deref() == Some(text.as_str())).then_some(rows)
    }

    /// Drops what was sent ahead: a statement ran before the take that would have read it, and
    /// may have changed its rows.
    fn forget_ahead(&self) {
        *self
            .sent_ahead
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// Sends `BEGIN` (and the statements asked for with it) when the transaction was not
    /// begun yet.
    pub(crate) async fn begun_before(&self) -> Result<(), DbErr> {
        if !self.begun() {
            self.begin(None).await?;
        }
        Ok(())
    }
}

#[async_trait]
impl ConnectionTrait for Held {
    fn get_database_backend(&self) -> DbBackend {
        self.conn.get_database_backend()
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        self.begun_before().await?;
        self.forget_ahead();
        self.conn.execute_raw(stmt).await
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        self.begun_before().await?;
        self.forget_ahead();
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
