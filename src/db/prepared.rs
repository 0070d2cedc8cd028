//! freshlock's statements in a message of several statements, planned once per connection: on
//! PostgreSQL (not behind a transaction pooler, which shares server connections) a statement
//! goes as `EXECUTE freshlock_<hash of its text>(values)`, its `PREPARE` in the same message
//! when the connection does not have it yet. As plain text the server plans it on every
//! message: a job's completion took 0.63 ms to plan cold, `freshlock_job` having many indexes,
//! and 0.05 ms to run, and jobs in few flights ran at 0.70× of the engine's rate on loopback.
//!
//! Which names a connection has is read at the end of each transaction's first message
//! ([`Prepared::begin`]); its first statement cannot know yet, so it goes as `EXECUTE` and, when
//! the connection turns out not to have it (SQLSTATE 26000: the message stopped there), again
//! after `ROLLBACK` and its `PREPARE` — one round trip, once per connection and statement (the
//! server logs that error once). A `PREPARE` is not undone by a rollback.

use std::{
    collections::HashSet,
    hash::{Hash, Hasher},
    sync::{Mutex, PoisonError},
};

use sea_orm::{DbErr, Statement};

use super::{
    failure::is_missing_prepared,
    inline::statement_text,
    pinned::{Pinned, Reply},
};

/// The statement a first message ends with: the names of freshlock's statements prepared on
/// the connection.
const NAMES: &str = "SELECT array_to_string(ARRAY(SELECT name FROM pg_prepared_statements \
     WHERE name LIKE 'freshlock\\_%'), ' ') AS freshlock_prepared";

/// The statements a connection has prepared for freshlock (see the module docs), as one
/// transaction on it knows them.
#[derive(Debug, Default)]
pub(crate) struct Prepared {
    /// Whether statements go as `EXECUTE` (else as plain text).
    on: bool,
    /// The names the connection has: read with `BEGIN`, and those the messages prepare.
    names: Mutex<HashSet<String>>,
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
    /// Statements by name when `on` (PostgreSQL, not behind a transaction pooler), else as text.
    pub(crate) fn new(on: bool) -> Self {
        Self {
            on,
            names: Mutex::default(),
        }
    }

    /// `stmt` as a message sends it, its values written in, or `None` when one cannot be.
    pub(crate) fn text(&self, stmt: &Statement) -> Option<Text> {
        let text = statement_text(stmt)?;
        if !self.on {
            return Some(Text {
                prepare: None,
                text,
            });
        }
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
        if self.on {
            statements.push(NAMES);
        }
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
        if self.on {
            let names = rest.pop().ok_or_else(short)?;
            let names = (names.rows.first())
                .map(|row| row.try_get::<String>("", "freshlock_prepared"))
                .transpose()?
                .unwrap_or_default();
            *self.names.lock().unwrap_or_else(PoisonError::into_inner) =
                names.split_whitespace().map(str::to_owned).collect();
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
