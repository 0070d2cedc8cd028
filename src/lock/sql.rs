//! SQL shared by the database-backed lock backends, per dialect.

use sea_orm::{DbBackend, DbErr, Statement, Value};

use crate::{
    db::failure::{Failure, classify},
    error::LockError,
    schema::MIGRATION_NAME,
};

/// The database clock in milliseconds since the Unix epoch. Only this clock decides whether a
/// lease has expired: worker clocks may be minutes off.
pub(crate) fn now_ms(backend: DbBackend) -> &'static str {
    match backend {
        DbBackend::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        DbBackend::MySql => "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
        _ => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    }
}

/// ` FOR UPDATE` off SQLite (whose `BEGIN IMMEDIATE` already excludes other writers), `""` on
/// SQLite.
pub(crate) fn for_update(backend: DbBackend) -> &'static str {
    if backend == DbBackend::Sqlite {
        ""
    } else {
        " FOR UPDATE"
    }
}

/// ` FOR UPDATE SKIP LOCKED` off SQLite, `""` on SQLite (see [`for_update`]).
pub(crate) fn for_update_skip_locked(backend: DbBackend) -> &'static str {
    if backend == DbBackend::Sqlite {
        ""
    } else {
        " FOR UPDATE SKIP LOCKED"
    }
}

/// A lease's fence check (`fence::verify`, for `redis`) as a condition of
/// another statement's `WHERE` (see `Locking::folding`): true when the row of `name` (the first
/// value) holds `fence` (the second), which it then locks until the transaction ends, as the
/// check by a statement of its own does; false, never waiting, when it does not or another
/// transaction has it locked (a fence being bumped). Not for SQLite, whose statements are no
/// round trips.
pub(crate) fn fence_folded(backend: DbBackend) -> &'static str {
    if backend == DbBackend::Postgres {
        "EXISTS (SELECT 1 FROM freshlock_lock WHERE name = $1 AND fence = $2 \
         FOR UPDATE SKIP LOCKED)"
    } else {
        "EXISTS (SELECT 1 FROM freshlock_lock WHERE name = ? AND fence = ? \
         FOR UPDATE SKIP LOCKED)"
    }
}

/// A statement from SQL written with `?` placeholders (numbered `$n` for PostgreSQL). A `?`
/// inside a quoted literal or identifier (`'…'`, `"…"`, quotes doubled inside) is text, not a
/// placeholder.
pub(crate) fn statement(backend: DbBackend, sql: &str, values: Vec<Value>) -> Statement {
    let sql = if backend == DbBackend::Postgres {
        numbered(sql, 1)
    } else {
        sql.to_owned()
    };
    Statement::from_sql_and_values(backend, sql, values)
}

/// A backend's database error, naming the migration when freshlock's table is missing.
pub(crate) fn lock_error(backend: &'static str, table: &'static str, err: DbErr) -> LockError {
    if classify(&err) == Failure::MissingTable {
        return LockError::MissingTable {
            table,
            migration: MIGRATION_NAME,
        };
    }
    LockError::Backend {
        backend,
        source: Box::new(err),
    }
}

/// Milliseconds of a duration, saturating.
pub(crate) fn millis(duration: std::time::Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// `sql` with each `?` outside quotes numbered `$first`, `$first + 1`, …: scanned as bytes
/// (every byte of a multi-byte UTF-8 character is above ASCII, so no quote or `?` is misread
/// and every cut is at a character boundary), the text between placeholders copied in slices.
/// Every grant and lease check goes through here: a character at a time cost ~25,000
/// instructions per grant.
pub(super) fn numbered(sql: &str, first: u32) -> String {
    use std::fmt::Write as _;
    let mut numbered = String::with_capacity(sql.len() + 16);
    let (mut n, mut quote, mut copied) = (first.saturating_sub(1), None::<u8>, 0);
    for (at, byte) in sql.bytes().enumerate() {
        match quote {
            // A doubled quote closes and reopens: the same state either way.
            Some(q) if byte == q => quote = None,
            Some(_) => {}
            None if byte == b'\'' || byte == b'"' => quote = Some(byte),
            None if byte == b'?' => {
                n += 1;
                numbered.push_str(&sql[copied..at]);
                let _ = write!(numbered, "${n}");
                copied = at + 1;
            }
            None => {}
        }
    }
    numbered.push_str(&sql[copied..]);
    numbered
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_numbered_outside_quotes_only() {
        let sql = "SELECT ? FROM t WHERE a = '?' AND \"b?\" = ? AND c = 'it''s ?' AND d = ?";
        let pg = statement(DbBackend::Postgres, sql, vec![]);
        assert_eq!(
            pg.sql,
            "SELECT $1 FROM t WHERE a = '?' AND \"b?\" = $2 AND c = 'it''s ?' AND d = $3"
        );
        let mysql = statement(DbBackend::MySql, sql, vec![]);
        assert_eq!(mysql.sql, sql);
        // Multi-byte text next to placeholders, in and out of quotes.
        let sql = "SELECT 'é?ß' AS \"ü?\", ? AS ö, ?";
        let pg = statement(DbBackend::Postgres, sql, vec![]);
        assert_eq!(pg.sql, "SELECT 'é?ß' AS \"ü?\", $1 AS ö, $2");
        assert_eq!(numbered("?", 1), "$1");
        assert_eq!(numbered("", 1), "");
        assert_eq!(numbered("? '?' ?", 4), "$4 '?' $5");
        let many = "?,".repeat(12);
        assert!(
            numbered(&many, 1).ends_with("$11,$12,"),
            "{}",
            numbered(&many, 1)
        );
    }
}
