//! The fence floor of `freshlock_lock` (see [`crate::schema`]): a new row's first fence is one
//! above it, and rows are deleted only when that keeps every name's fences growing.
//!
//! Two ways rows go:
//! - a grant that turned out to protect nothing (its key did not exist) deletes its own row when
//!   that row has no history above the floor ([`retire_sql`]): the next grant of the name
//!   starts at floor + 1 again, above every fence the name had before this unused one;
//! - [`crate::inspect::compact`] deletes idle rows and raises the floor to their highest fence,
//!   excluding concurrent first grants while it does (PostgreSQL: a table lock that writers wait
//!   for before their statement's snapshot; MySQL: the floor row, which first grants read with
//!   a shared lock; SQLite: the one writer).

use crate::schema::{FLOOR_NAME, LOCK_TABLE};

/// The first fence of a new row, as a scalar expression (PostgreSQL, SQLite).
pub(crate) fn first_fence() -> String {
    format!("COALESCE((SELECT fence FROM {LOCK_TABLE} WHERE name = '{FLOOR_NAME}'), 0) + 1")
}

/// MySQL/MariaDB: the first fence of a new row in an `INSERT … SELECT … FROM` [`mysql_floor`].
pub(crate) const MYSQL_FIRST_FENCE: &str = "COALESCE(MAX(floor_row.fence), 0) + 1";

/// MySQL/MariaDB: the `FROM` of an `INSERT … SELECT` of a new row: the floor, read under a
/// shared lock (a compaction holds it exclusively while it deletes, so a first grant never
/// reads a floor that is about to rise). One row, also without a floor row.
pub(crate) fn mysql_floor() -> String {
    format!(
        " FROM {LOCK_TABLE} AS floor_row WHERE floor_row.name = '{FLOOR_NAME}' LOCK IN SHARE MODE"
    )
}

/// MySQL/MariaDB: the next fence of a name (`?`) — a new row one above the floor, an existing
/// row one above its last — written with `LAST_INSERT_ID(expr)`, so that the statement's own
/// reply (its OK packet's insert id) carries it: no statement more to read it. The one fence bump
/// on MySQL, for `redis`'s fences (and, gated by its grant's token, `mysql_named`'s, in the
/// write's transaction). A literal: sqlx takes only audited SQL strings (the test below checks
/// it against the parts it spells out).
#[cfg_attr(not(any(feature = "mysql", feature = "redis")), allow(dead_code))]
pub(crate) const MYSQL_BUMP_FENCE: &str = "INSERT INTO freshlock_lock (name, fence, expires_at, acquired_at) \
    SELECT ?, LAST_INSERT_ID(COALESCE(MAX(floor_row.fence), 0) + 1), 0, \
    CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED) \
    FROM freshlock_lock AS floor_row WHERE floor_row.name = '' LOCK IN SHARE MODE \
    ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(freshlock_lock.fence + 1), \
    acquired_at = CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";

/// Deletes the row of a name (`?`, then the `condition`'s own values) when its fence is at most
/// floor + 1: no fence of the name above the floor but this grant's. (A derived table, so that
/// MySQL accepts reading the table it deletes from.)
pub(crate) fn retire_sql(condition: &str) -> String {
    format!(
        "DELETE FROM {LOCK_TABLE} WHERE name = ? AND {condition} AND fence <= \
         (SELECT bound FROM (SELECT COALESCE(MAX(fence), 0) + 1 AS bound FROM {LOCK_TABLE} \
         WHERE name = '{FLOOR_NAME}') AS floor_row)"
    )
}

#[cfg(test)]
mod tests {
    use sea_orm::DbBackend;

    use super::*;

    #[test]
    fn the_mysql_bump_spells_out_the_floor_and_the_clock() {
        assert!(MYSQL_BUMP_FENCE.starts_with(&format!("INSERT INTO {LOCK_TABLE} ")));
        assert!(MYSQL_BUMP_FENCE.contains(&format!("LAST_INSERT_ID({MYSQL_FIRST_FENCE})")));
        assert!(MYSQL_BUMP_FENCE.contains(&mysql_floor()));
        assert!(MYSQL_BUMP_FENCE.contains(&format!("{LOCK_TABLE}.fence + 1")));
        assert!(MYSQL_BUMP_FENCE.contains(crate::lock::sql::now_ms(DbBackend::MySql)));
    }
}
