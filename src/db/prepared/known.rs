//! What a pool knows of the statements each of its connections prepared for freshlock: the
//! names last read from a connection, by the token in its session's settings (see the parent
//! module's docs for why, and for where this could go wrong).

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use sea_orm::DbErr;

use super::short;
use crate::db::pinned::Pinned;

/// The names of freshlock's statements prepared on the connection, as an expression.
const NAMES: &str = "(SELECT array_to_string(ARRAY(SELECT name FROM pg_prepared_statements \
     WHERE name LIKE 'freshlock\\_%'), ' '))";

/// The session setting that holds a connection's token (see the module docs).
const TOKEN: &str = "freshlock.conn";

/// How many connections' names a pool keeps at most: tokens of connections closed since are
/// never seen again, and all are dropped when there are more (each connection's names are then
/// read once more).
const KNOWN_AT_MOST: usize = 1024;

/// How many stale tokens a pool keeps at most: each is written into every first message until
/// its connection's names are read (a connection closed before that leaves its token there), so
/// all are dropped when there are more (their names are then read in a message of their own).
const STALE_AT_MOST: usize = 16;

/// How many first messages a stale token is written into at most (each of them asks for the
/// names): a connection closed before its names were read leaves its token there, and a
/// connection of a pool of 16 is taken by none of 256 messages once in ~15 million.
pub(super) const STALE_FOR: u32 = 256;

/// Which statements each connection of a pool prepared for freshlock, by the connection's
/// token, as last read from it (see the module docs). Owned by the pool.
#[derive(Debug)]
pub(crate) struct Known {
    /// The start of this pool's tokens (unique to the pool and the process).
    nonce: String,
    /// The next token's number.
    next: AtomicU64,
    by_token: Mutex<ByToken>,
}

/// What a pool knows of its connections, by token.
#[derive(Debug, Default)]
struct ByToken {
    /// The names last read from each connection.
    names: HashMap<String, Arc<HashSet<String>>>,
    /// Connections that prepared a statement since: their names are read with the next `BEGIN`
    /// (by token, with how many more first messages ask for them).
    stale: HashMap<String, u32>,
}

impl Known {
    /// Nothing known yet.
    pub(crate) fn new() -> Self {
        Self {
            nonce: crate::lock::holder::new_token(),
            next: AtomicU64::new(0),
            by_token: Mutex::default(),
        }
    }

    /// A token no connection has yet.
    pub(super) fn fresh(&self) -> String {
        format!(
            "{}.{}",
            self.nonce,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// The statement a first message ends with, and whether it asks for names: the connection's
    /// token, given `fresh` when it has none of this pool's; the names it has, read when it was
    /// just given one or its token is stale (asked for only while a token is), or `again`.
    /// (Tokens are hex digits, `-` and `.`: written in as they are.)
    pub(super) fn statement(&self, fresh: &str, again: bool) -> (String, bool) {
        if again {
            let statement = format!(
                "SELECT set_config('{TOKEN}', '{fresh}', false) AS freshlock_conn, \
                 {NAMES} AS freshlock_prepared"
            );
            return (statement, true);
        }
        let nonce = &self.nonce;
        let token = format!(
            "CASE WHEN current_setting('{TOKEN}', true) LIKE '{nonce}.%' THEN \
             current_setting('{TOKEN}', true) ELSE set_config('{TOKEN}', '{fresh}', false) END"
        );
        let mut known = self.lock();
        if known.stale.is_empty() {
            return (format!("SELECT {token} AS freshlock_conn"), false);
        }
        known.stale.retain(|_, left| {
            *left -= 1;
            *left > 0
        });
        let stale: String = (known.stale.keys())
            .map(|token| format!(", '{token}'"))
            .collect();
        let statement = format!(
            "SELECT c AS freshlock_conn, CASE WHEN c IN ('{fresh}'{stale}) THEN {NAMES} END \
             AS freshlock_prepared FROM (SELECT {token} AS c) AS t"
        );
        (statement, true)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ByToken> {
        self.by_token.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The names last read from the connection of `token`.
    pub(super) fn get(&self, token: &str) -> Option<Arc<HashSet<String>>> {
        self.lock().names.get(token).cloned()
    }

    /// Keeps `names` as read from the connection of `token`.
    pub(super) fn keep(&self, token: String, names: Arc<HashSet<String>>) {
        let mut known = self.lock();
        if known.names.len() >= KNOWN_AT_MOST && !known.names.contains_key(&token) {
            known.names.clear();
        }
        known.stale.remove(&token);
        known.names.insert(token, names);
    }

    /// Forgets the names of the connection of `token`, which prepares one more: read them with
    /// its next `BEGIN`.
    pub(super) fn forget(&self, token: &str) {
        let mut known = self.lock();
        known.names.remove(token);
        if known.stale.len() >= STALE_AT_MOST {
            known.stale.clear();
        }
        known.stale.insert(token.to_owned(), STALE_FOR);
    }
}

/// The names of freshlock's statements prepared on `conn`, read in a message of their own
/// (its token is this pool's, but the pool does not know them: see the module docs).
pub(super) async fn read_names(conn: &Pinned) -> Result<Arc<HashSet<String>>, DbErr> {
    let reply = conn
        .flight(format!("SELECT {NAMES} AS freshlock_prepared"))
        .await?;
    let reply = reply.into_iter().next().ok_or_else(short)?;
    let names = (reply.rows.first())
        .map(|row| row.try_get::<String>("", "freshlock_prepared"))
        .transpose()?
        .unwrap_or_default();
    Ok(Arc::new(
        names.split_whitespace().map(str::to_owned).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(names: &[&str]) -> Arc<HashSet<String>> {
        Arc::new(names.iter().map(|name| (*name).to_owned()).collect())
    }

    #[test]
    fn a_pools_tokens_are_its_own_and_never_the_same() {
        let (one, other) = (Known::new(), Known::new());
        let (a, b) = (one.fresh(), one.fresh());
        assert_ne!(a, b);
        assert!(a.starts_with(&format!("{}.", one.nonce)));
        assert!(!other.fresh().starts_with(&format!("{}.", one.nonce)));
        // Written into SQL as they are.
        assert!(
            a.chars()
                .all(|c| c.is_ascii_hexdigit() || c == '-' || c == '.')
        );
    }

    #[test]
    fn a_connection_that_prepares_has_its_names_read_with_its_next_begin() {
        let known = Known::new();
        known.keep("t.1".into(), names(&["freshlock_a"]));
        assert_eq!(known.get("t.1"), Some(names(&["freshlock_a"])));
        let (statement, asks) = known.statement("t.9", false);
        assert!(!asks && !statement.contains("pg_prepared_statements"));
        known.forget("t.1");
        assert_eq!(known.get("t.1"), None, "not trusted once it prepared");
        let (statement, asks) = known.statement("t.9", false);
        assert!(asks && statement.contains("IN ('t.9', 't.1')"));
        known.keep("t.1".into(), names(&["freshlock_a", "freshlock_b"]));
        let (statement, asks) = known.statement("t.9", false);
        assert!(!asks && !statement.contains("'t.1'"), "read: not stale");
        assert!(known.statement("t.9", true).1, "again: always read");
    }

    #[test]
    fn a_stale_token_is_asked_for_in_so_many_messages_only() {
        let known = Known::new();
        known.forget("t.1");
        for _ in 0..STALE_FOR {
            assert!(known.statement("t.9", false).1);
        }
        assert!(
            !known.statement("t.9", false).1,
            "its connection was closed, say"
        );
        assert_eq!(
            known.get("t.1"),
            None,
            "and its names are read when it comes back"
        );
    }

    #[test]
    fn what_a_pool_keeps_is_bounded() {
        let known = Known::new();
        for n in 0..KNOWN_AT_MOST + 1 {
            known.keep(format!("t.{n}"), names(&[]));
        }
        assert_eq!(
            known.lock().names.len(),
            1,
            "dropped when full, then the newest"
        );
        for n in 0..STALE_AT_MOST + 1 {
            known.forget(&format!("t.{n}"));
        }
        assert_eq!(known.lock().stale.len(), 1);
        assert_eq!(known.get(&format!("t.{STALE_AT_MOST}")), None);
    }
}
