//! freshlock's statements in a message of several statements, planned once per connection: on
//! PostgreSQL (not behind a transaction pooler, which shares server connections) a statement
//! goes as `EXECUTE freshlock_<hash of its text>(values)`, its `PREPARE` in the same message
//! when the connection does not have it yet. As plain text the server plans it on every
//! message: a job's completion took 0.63 ms to plan cold, `freshlock_job` having many indexes,
//! and 0.05 ms to run, and jobs in few flights ran at 0.70× of the engine's rate on loopback.
//!
//! A transaction's first statement goes as `EXECUTE` before the transaction knows which names
//! the connection has (they come with the first message's reply); when the connection turns out
//! not to have it (SQLSTATE 26000: the message stopped there), it goes again after `ROLLBACK`
//! and its `PREPARE` — one round trip, once per connection and statement (the server logs that
//! error once). A `PREPARE` is not undone by a rollback. A transaction whose only message is its
//! last (a leased finish that sends nothing but its completion) sends every statement so
//! ([`Prepared::assumed`]); when the connection lacks one, the message stops before its
//! `COMMIT`, and `ROLLBACK` with the names read, then the message again after the `PREPARE`s
//! it lacks, cost two round trips.
//!
//! Which names a connection has is read from the server (`pg_prepared_statements`) only when
//! the pool does not know it ([`Known`]): that read lists every statement the connection
//! prepared, sqlx's too, with its text, and made on every transaction it took a tenth of the
//! server's time in jobs of one `UPDATE` (`perf`, on loopback). A connection is
//! known by a token in a setting of its session (`freshlock.conn`), given by the first message
//! that finds none of this pool's there; the pool keeps, by token, the names last read from the
//! connection. The first message asks for the names (a subquery the server plans on every
//! message even when it does not run it: 0.06 ms, against 0.01 for the token alone) only while
//! some connection's are stale; otherwise it reads the token alone, and a token the pool does
//! not know has its names read in a message of their own. Where this could go wrong the names
//! are read again, never guessed:
//! - a token set in a transaction that rolls back is undone with it: the next first message
//!   gives a new one, and its names are read;
//! - a transaction that prepares a statement forgets its connection's names (a `PREPARE`
//!   written but never sent would otherwise count as made) and marks its token stale: the next
//!   first message on the connection reads them (one whose token the pool dropped to keep its
//!   lists short, or left stale for [`STALE_FOR`](known::STALE_FOR) first messages, reads them
//!   in a message of its own);
//! - a token of another pool or process (a session a pooler handed on) is replaced;
//! - statements dropped behind freshlock's back (`DEALLOCATE ALL`): the first statement's
//!   SQLSTATE 26000 sends it again with its `PREPARE` and reads the names with it. (Had only a
//!   later statement's been dropped, its message would fail before its `COMMIT`: nothing of
//!   it written, the call failing with the error — a job's attempt is retried as after any.)

mod known;

use std::{
    collections::HashSet,
    hash::{Hash, Hasher},
    sync::{Arc, Mutex, PoisonError},
};

use sea_orm::{DbErr, Statement};

pub(crate) use known::Known;
use known::read_names;

use super::{
    failure::is_missing_prepared,
    inline::statement_text,
    pinned::{Pinned, Reply},
};

/// The statements a connection has prepared for freshlock (see the module docs), as one
/// transaction on it knows them.
#[derive(Debug, Default)]
pub(crate) struct Prepared {
    /// The pool's names by connection, when statements go as `EXECUTE` (else as plain text).
    known: Option<Arc<Known>>,
    /// The names the connection has: read or known with `BEGIN`, and those the messages
    /// prepare.
    names: Mutex<HashSet<String>>,
    /// The connection's token, once `BEGIN`'s message read it.
    token: Mutex<Option<String>>,
    /// Statements written as `EXECUTE` before the names were read, on the assumption that the
    /// connection has them ([`assumed`](Self::assumed)): each name with its `PREPARE`.
    assumed: Mutex<Vec<(String, String)>>,
}

/// A statement as a message sends it.
pub(crate) struct Text {
    /// `PREPARE name AS …`, to send before [`text`](Self::text) when the connection does not
    /// have the statement (for a first statement: when it turns out not to).
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

impl Prepared {
    /// Statements by name with `known`, the pool's (PostgreSQL, not behind a transaction
    /// pooler), else as text.
    pub(crate) fn new(known: Option<Arc<Known>>) -> Self {
        Self {
            known,
            names: Mutex::default(),
            token: Mutex::default(),
            assumed: Mutex::default(),
        }
    }

    /// Whether statements go as `EXECUTE` of statements prepared on the connection.
    pub(crate) fn by_name(&self) -> bool {
        self.known.is_some()
    }

    /// Whether the names the connection has are known: read with `BEGIN` (or statements go as
    /// text, and there are none to know).
    pub(crate) fn names_read(&self) -> bool {
        !self.by_name()
            || self
                .token
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_some()
    }

    /// `stmt` as a transaction's only message sends it, the names the connection has not read
    /// (nothing was sent before it): as `EXECUTE`, assuming the connection has it — it has once
    /// a transaction on it sent the statement, as any connection of a warm pool has. When it
    /// has not, the message stops there before its `COMMIT` (SQLSTATE 26000) and
    /// [`missing`](Self::missing) gives the `PREPARE`s to send it again with.
    pub(crate) fn assumed(&self, stmt: &Statement) -> Option<Text> {
        let mut text = self.text(stmt)?;
        if let Some(prepare) = text.prepare.take() {
            let name = prepare
                .split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_owned();
            (self.assumed.lock().unwrap_or_else(PoisonError::into_inner)).push((name, prepare));
        }
        Some(text)
    }

    /// After a message of [`assumed`](Self::assumed) statements stopped at one the connection
    /// does not have (its transaction aborted): `ROLLBACK`, and the connection's names read
    /// (with a token of this pool's, marked stale: the caller prepares what is missing) — the
    /// `PREPARE`s of the assumed statements it lacks, to send before the message again.
    /// `None` when no statement was assumed (the error is another's).
    pub(crate) async fn missing(&self, conn: &Pinned) -> Result<Option<Vec<String>>, DbErr> {
        let assumed =
            std::mem::take(&mut *self.assumed.lock().unwrap_or_else(PoisonError::into_inner));
        let Some(known) = self.known.as_ref().filter(|_| !assumed.is_empty()) else {
            return Ok(None);
        };
        let token = known.fresh();
        let (read, _) = known.statement(&token, true);
        let mut replies = conn.flight(format!("ROLLBACK; {read}")).await?;
        let reply = replies.pop().ok_or_else(short)?;
        let row = reply.rows.first().ok_or_else(short)?;
        let read: Option<String> = row.try_get("", "freshlock_prepared")?;
        let has: HashSet<&str> = read
            .as_deref()
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        let missing: Vec<String> = (assumed.into_iter())
            .filter(|(name, _)| !has.contains(name.as_str()))
            .map(|(_, prepare)| prepare)
            .collect();
        // Read, then changed by the `PREPARE`s: the next `BEGIN` on it reads them again.
        known.forget(&token);
        Ok(Some(missing))
    }

    /// `stmt` as a message sends it, its values written in, or `None` when one cannot be.
    pub(crate) fn text(&self, stmt: &Statement) -> Option<Text> {
        let text = statement_text(stmt)?;
        let Some(known) = &self.known else {
            return Some(Text {
                prepare: None,
                text,
            });
        };
        let types = types(stmt)?;
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (&stmt.sql, &types).hash(&mut hasher);
        let name = format!("freshlock_{:016x}", hasher.finish());
        let values = (stmt.values.as_ref()).map_or(0, |values| values.0.len());
        let arguments = (1..=values)
            .map(|n| format!("${n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let execute = match values {
            0 => format!("EXECUTE {name}"),
            _ => format!("EXECUTE {name}({arguments})"),
        };
        let text = statement_text(&Statement {
            sql: execute,
            ..stmt.clone()
        })?;
        let mut names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        let prepare = (names.insert(name.clone())).then(|| match values {
            0 => format!("PREPARE {name} AS {}", stmt.sql),
            _ => format!("PREPARE {name} ({types}) AS {}", stmt.sql),
        });
        if prepare.is_some()
            && let Some(token) = &*self.token.lock().unwrap_or_else(PoisonError::into_inner)
        {
            known.forget(token);
        }
        Some(Text { prepare, text })
    }

    /// A transaction's first message on `conn`: `begin` (its statements `;`-separated), `first`
    /// (sent as `EXECUTE` without its `PREPARE`: see the module docs), `with`, then the names
    /// the connection has. `first`'s reply and `with`'s, in order.
    pub(crate) async fn begin(
        &self,
        conn: &Pinned,
        begin: &str,
        first: Option<&Text>,
        with: Option<&str>,
    ) -> Result<(Option<Reply>, Vec<Reply>), DbErr> {
        match self.send_begin(conn, begin, first, with, false).await {
            Err(e) if is_missing_prepared(&e) && first.is_some_and(|f| f.prepare.is_some()) => {
                self.send_begin(conn, begin, first, with, true).await
            }
            sent => sent,
        }
    }

    /// [`begin`](Self::begin)'s message; `again`: after one stopped at `first`'s `EXECUTE`
    /// (`ROLLBACK` first, then its `PREPARE`).
    async fn send_begin(
        &self,
        conn: &Pinned,
        begin: &str,
        first: Option<&Text>,
        with: Option<&str>,
        again: bool,
    ) -> Result<(Option<Reply>, Vec<Reply>), DbErr> {
        let mut statements: Vec<&str> = Vec::with_capacity(6);
        if again {
            statements.push("ROLLBACK");
            if let Some(prepare) = first.and_then(|first| first.prepare.as_deref()) {
                statements.push(prepare);
            }
        }
        // `ROLLBACK`'s and `PREPARE`'s replies, `BEGIN`'s own (and `SET TRANSACTION`'s).
        let skip = statements.len() + begin.split(';').count();
        statements.push(begin);
        if let Some(first) = first {
            statements.push(&first.text);
        }
        if let Some(with) = with {
            statements.push(with);
        }
        let ending = (self.known.as_ref()).map(|known| known.statement(&known.fresh(), again));
        statements.extend(ending.as_ref().map(|(ending, _)| ending.as_str()));
        let mut replies = conn
            .flight(statements.join("; "))
            .await?
            .into_iter()
            .skip(skip);
        let first = match first {
            Some(_) => Some(replies.next().ok_or_else(short)?),
            None => None,
        };
        let mut rest: Vec<Reply> = replies.collect();
        if let Some(known) = &self.known {
            let reply = rest.pop().ok_or_else(short)?;
            let row = reply.rows.first().ok_or_else(short)?;
            let token: String = row.try_get("", "freshlock_conn")?;
            let read: Option<String> = match ending.is_some_and(|(_, asks)| asks) {
                true => row.try_get("", "freshlock_prepared")?,
                false => None,
            };
            let names = match read {
                Some(read) => {
                    let names = Arc::new(read.split_whitespace().map(str::to_owned).collect());
                    known.keep(token.clone(), Arc::clone(&names));
                    names
                }
                None => match known.get(&token) {
                    Some(names) => names,
                    None => {
                        let names = read_names(conn).await?;
                        known.keep(token.clone(), Arc::clone(&names));
                        names
                    }
                },
            };
            *self.names.lock().unwrap_or_else(PoisonError::into_inner) = (*names).clone();
            *self.token.lock().unwrap_or_else(PoisonError::into_inner) = Some(token);
        }
        Ok((first, rest))
    }
}

/// The types of `stmt`'s parameters as its `PREPARE` names them: those sqlx binds its values
/// as. A parameter's type is not always inferred from its use (`CASE … THEN now + $3` reads
/// `$3` as text). `None` when a value has no such type (the statement is sent bound).
#[cfg(feature = "postgres")]
fn types(stmt: &Statement) -> Option<String> {
    let values = stmt.values.iter().flat_map(|values| values.0.iter());
    let types = values.map(super::inline::postgres::type_name);
    Some(types.collect::<Option<Vec<_>>>()?.join(", "))
}

/// Statements go by name only on PostgreSQL.
#[cfg(not(feature = "postgres"))]
fn types(_: &Statement) -> Option<String> {
    None
}

/// A message that answered fewer statements than it sent (the server stops at a failing one,
/// whose error the message reports instead).
pub(crate) fn short() -> DbErr {
    DbErr::Custom("a message's reply answered fewer statements than it sent".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statement_made_after_begin_forgets_the_connections_names() {
        let known = Arc::new(Known::new());
        known.keep("t.1".into(), Arc::default());
        let prepared = Prepared::new(Some(Arc::clone(&known)));
        *prepared.token.lock().unwrap() = Some("t.1".into());
        let stmt = Statement::from_sql_and_values(
            sea_orm::DbBackend::Postgres,
            "SELECT 1 WHERE $1 = 1",
            [1i32.into()],
        );
        let text = prepared.text(&stmt).expect("written in");
        assert!(text.prepare.is_some());
        assert_eq!(known.get("t.1"), None);
        // Made once: the same statement again is only executed.
        assert!(prepared.text(&stmt).expect("written in").prepare.is_none());
    }
}
