//! The lease row, written once for the two tables that hold one: the `table` backend's
//! `freshlock_lock` and the claims' `freshlock_claim`. One row per name holds its holder (owner
//! token, host, pid, label), its expiry on the **database clock** and a fence that grows with
//! every grant; a grant takes the row only in the states its table allows ([`Takeable`]).
//!
//! Per dialect: PostgreSQL and SQLite grant in one atomic statement (insert the row, or take the
//! existing one when it is takeable, `RETURNING fence`); a held row may cost a second statement
//! (the `table` backend's takeover of an expired lease). MySQL/MariaDB, without `RETURNING`,
//! take the existing row with an `UPDATE`, else insert it with `INSERT IGNORE`, else take over an
//! expired lease, and then read the fence back.
//!
//! Written as SQL text with `?` placeholders (see [`super::sql::statement`]) rather than built
//! with sea-query: sea-query 1.0 renders a MySQL "insert unless present" as either
//! `ON DUPLICATE KEY IGNORE` (not MySQL) or `ON DUPLICATE KEY UPDATE name = name`, whose
//! affected-row count is 1 for a row that was already there under sqlx's `CLIENT_FOUND_ROWS` —
//! a held lease would read as granted. `INSERT IGNORE` says what is meant.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Statement, Value};

use super::{
    floor, holder,
    sql::{millis, now_ms, statement},
};
use crate::{
    db::failure::{Failure, classify},
    schema::{CLAIM_TABLE, LOCK_TABLE},
};

/// Which rows of a name a grant may take.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Takeable {
    /// Released (no owner).
    Free,
    /// Held, but the holder's lease has run out: a takeover.
    Expired,
    /// A claim not done whose lease has run out (or was never held).
    NotDone,
}

/// A table of lease rows.
#[derive(Debug)]
pub(crate) struct LeaseTable {
    table: &'static str,
    /// The column stamped with the grant time.
    granted_at: &'static str,
    /// Claims: a grant sets `state = 'processing'`.
    claim_state: bool,
    /// The states a grant takes, in the order tried; every one after the first is a takeover.
    takes: &'static [Takeable],
}

/// `freshlock_lock`: a free row first, then an expired lease (a takeover, logged by the caller).
pub(crate) const LOCKS: LeaseTable = LeaseTable {
    table: LOCK_TABLE,
    granted_at: "acquired_at",
    claim_state: false,
    takes: &[Takeable::Free, Takeable::Expired],
};

/// `freshlock_claim`: any claim not done whose lease has run out.
pub(crate) const CLAIMS: LeaseTable = LeaseTable {
    table: CLAIM_TABLE,
    granted_at: "claimed_at",
    claim_state: true,
    takes: &[Takeable::NotDone],
};

/// Whom a grant is for.
#[derive(Debug)]
pub(crate) struct Holder<'a> {
    /// The holder's secret token (the owner column).
    pub(crate) token: &'a str,
    /// How long the lease lasts, from the database's now.
    pub(crate) ttl: Duration,
    /// A worker or task name, for the inspector.
    pub(crate) label: Option<&'a str>,
    /// Whether the grant's commit waits for its log flush. Not on PostgreSQL for a lease whose
    /// every use is checked in a transaction that commits after it (see [`returning_fence`] and
    /// `LeaseLock::acquire_checked`); elsewhere always.
    pub(crate) durable: bool,
}

impl Holder<'_> {
    /// The holder's columns, in the order the statements take them: owner, TTL, host, pid,
    /// label.
    fn values(&self) -> Vec<Value> {
        vec![
            self.token.into(),
            millis(self.ttl).into(),
            holder::host().into(),
            i64::from(std::process::id()).into(),
            self.label.map(str::to_owned).into(),
        ]
    }
}

/// A granted lease row.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Grant {
    /// The row's new fence.
    pub(crate) fence: i64,
    /// Whether it was taken over from a holder whose lease had run out.
    pub(crate) taken_over: bool,
}

/// ` RETURNING fence` of a grant (PostgreSQL, SQLite). For a grant that need not be durable by
/// itself on PostgreSQL ([`Holder::durable`] false), also `set_config('synchronous_commit',
/// 'off', true)`: evaluated for the row the statement takes, it lets that statement's own
/// (autocommit) transaction commit without waiting for the log flush. Safe there because the
/// log is flushed in order: the transaction of a write that checks the lease commits after the
/// grant, so its flush makes the grant durable first; a grant lost with a crash before any such
/// commit fails every check (the row does not hold its token), and nothing committed under it.
/// A busy try (no row) writes nothing to flush.
fn returning_fence(backend: DbBackend, holder: &Holder<'_>) -> &'static str {
    if backend == DbBackend::Postgres && !holder.durable {
        " RETURNING fence, set_config('synchronous_commit', 'off', true) AS relaxed_commit"
    } else {
        " RETURNING fence"
    }
}

impl LeaseTable {
    /// Grants `name`'s row to `holder` on `conn`, or `None` when the row is in a state its table
    /// does not let a grant take (held and live; a claim done). With `deadlock_is_busy`, a
    /// deadlock InnoDB reports on one of MySQL's single-row statements counts as "not taken by
    /// that statement" (the caller's next try sorts it out); otherwise it is returned.
    ///
    /// # Errors
    /// The database's.
    pub(crate) async fn grant<C: ConnectionTrait>(
        &self,
        conn: &C,
        name: &str,
        holder: &Holder<'_>,
        deadlock_is_busy: bool,
    ) -> Result<Option<Grant>, DbErr> {
        let backend = conn.get_database_backend();
        let mysql = backend == DbBackend::MySql;
        let (first, takeovers) = self
            .takes
            .split_first()
            .ok_or_else(|| DbErr::Custom(format!("{}: no grant condition", self.table)))?;
        // Elsewhere one upsert returns the fence it wrote. MySQL has no `RETURNING`: take the
        // row in the first takeable state, else insert it; each a single autocommit-sized
        // statement on one row, whose own reply carries the fence it wrote
        // (`LAST_INSERT_ID(expr)`: no statement more to read it). Then, on both, each
        // takeover, until one statement wrote the row.
        let head = match mysql {
            true => vec![
                self.take(backend, name, holder, *first),
                self.insert_mysql(name, holder),
            ],
            false => vec![self.upsert(backend, name, holder, *first)],
        };
        let takeovers =
            (takeovers.iter()).map(|takeable| (self.take(backend, name, holder, *takeable), true));
        let tries = head.into_iter().map(|statement| (statement, false));
        for (statement, taken_over) in tries.chain(takeovers) {
            let fence = match mysql {
                true => match conn.execute_raw(statement).await {
                    Ok(done) if done.rows_affected() == 1 => {
                        Some(i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX))
                    }
                    Ok(_) => None,
                    Err(e) if deadlock_is_busy && classify(&e) == Failure::Deadlock => None,
                    Err(e) => return Err(e),
                },
                false => (conn.query_one_raw(statement).await?)
                    .map(|row| row.try_get::<i64>("", "fence"))
                    .transpose()?,
            };
            if let Some(fence) = fence {
                return Ok(Some(Grant { fence, taken_over }));
            }
        }
        Ok(None)
    }

    /// `takeable` as a condition on the row, its columns qualified with the table's name (as an
    /// `ON CONFLICT … WHERE` needs).
    fn condition(&self, backend: DbBackend, takeable: Takeable) -> String {
        let (t, now) = (self.table, now_ms(backend));
        match takeable {
            Takeable::Free => format!("{t}.owner IS NULL"),
            Takeable::Expired => {
                format!("{t}.owner IS NOT NULL AND {t}.expires_at <= {now}")
            }
            Takeable::NotDone => format!("{t}.state <> 'done' AND {t}.expires_at <= {now}"),
        }
    }

    /// `, state = 'processing'` for claims.
    fn state_set(&self) -> &'static str {
        if self.claim_state {
            ", state = 'processing'"
        } else {
            ""
        }
    }

    /// Takes the existing row in state `takeable` (values: the holder's, then the name);
    /// `RETURNING fence` off MySQL.
    fn take(
        &self,
        backend: DbBackend,
        name: &str,
        holder: &Holder<'_>,
        takeable: Takeable,
    ) -> Statement {
        let (t, now, granted_at) = (self.table, now_ms(backend), self.granted_at);
        // MySQL has no RETURNING: `LAST_INSERT_ID(expr)` puts the new fence in the statement's
        // own reply (its OK packet's insert id, `ExecResult::last_insert_id`).
        let (fence, returning) = if backend == DbBackend::MySql {
            ("LAST_INSERT_ID(fence + 1)", "")
        } else {
            ("fence + 1", returning_fence(backend, holder))
        };
        let sql = format!(
            "UPDATE {t} SET fence = {fence}, owner = ?, expires_at = {now} + ?, host = ?, \
             pid = ?, label = ?, {granted_at} = {now}{state} \
             WHERE name = ? AND {condition}{returning}",
            state = self.state_set(),
            condition = self.condition(backend, takeable),
        );
        let mut values = holder.values();
        values.push(name.into());
        statement(backend, &sql, values)
    }

    /// The columns of a new row and their values (`?`: the name, then the holder's).
    fn new_row(&self, backend: DbBackend, first_fence: &str) -> (String, String) {
        let (now, granted_at) = (now_ms(backend), self.granted_at);
        let (state_column, state_value) = if self.claim_state {
            (" state,", " 'processing',")
        } else {
            ("", "")
        };
        (
            format!("name,{state_column} owner, fence, expires_at, host, pid, label, {granted_at}"),
            format!("?,{state_value} ?, {first_fence}, {now} + ?, ?, ?, ?, {now}"),
        )
    }

    /// The first fence of a new row: one above the fence floor for locks (see [`floor`]), 1
    /// for claims.
    fn first_fence(&self) -> String {
        if self.table == LOCK_TABLE {
            floor::first_fence()
        } else {
            "1".to_owned()
        }
    }

    /// PostgreSQL, SQLite: inserts the row, or takes the existing one in state `takeable`, in
    /// one statement `RETURNING fence` (no row when it was not takeable).
    fn upsert(
        &self,
        backend: DbBackend,
        name: &str,
        holder: &Holder<'_>,
        takeable: Takeable,
    ) -> Statement {
        let (t, granted_at) = (self.table, self.granted_at);
        let (columns, values) = self.new_row(backend, &self.first_fence());
        let sql = format!(
            "INSERT INTO {t} ({columns}) VALUES ({values}) \
             ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, fence = {t}.fence + 1, \
             expires_at = excluded.expires_at, host = excluded.host, pid = excluded.pid, \
             label = excluded.label, {granted_at} = excluded.{granted_at}{state} \
             WHERE {condition}{returning}",
            returning = returning_fence(backend, holder),
            state = self.state_set(),
            condition = self.condition(backend, takeable),
        );
        let mut bound = vec![Value::from(name)];
        bound.extend(holder.values());
        statement(backend, &sql, bound)
    }

    /// MySQL: inserts the row unless it exists. A lock row's first fence reads the fence floor
    /// under a shared lock (see [`floor::mysql_floor`]); it is written with `LAST_INSERT_ID(…)`,
    /// so the statement's own reply carries it (as [`Self::take`]'s).
    fn insert_mysql(&self, name: &str, holder: &Holder<'_>) -> Statement {
        let backend = DbBackend::MySql;
        let t = self.table;
        let sql = if self.table == LOCK_TABLE {
            let first = format!("LAST_INSERT_ID({})", floor::MYSQL_FIRST_FENCE);
            let (columns, values) = self.new_row(backend, &first);
            format!(
                "INSERT IGNORE INTO {t} ({columns}) SELECT {values}{floor}",
                floor = floor::mysql_floor()
            )
        } else {
            let first = format!("LAST_INSERT_ID({})", self.first_fence());
            let (columns, values) = self.new_row(backend, &first);
            format!("INSERT IGNORE INTO {t} ({columns}) VALUES ({values})")
        };
        let mut bound = vec![Value::from(name)];
        bound.extend(holder.values());
        statement(backend, &sql, bound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder() -> Holder<'static> {
        Holder {
            token: "t",
            ttl: Duration::from_secs(1),
            label: None,
            durable: true,
        }
    }

    #[test]
    fn lock_and_claim_rows_are_granted_by_the_same_statements_with_their_own_columns() {
        let pg = DbBackend::Postgres;
        let lock = LOCKS.upsert(pg, "n", &holder(), Takeable::Free).sql;
        assert!(lock.contains("acquired_at = excluded.acquired_at WHERE freshlock_lock.owner IS NULL RETURNING fence"), "{lock}");
        assert!(lock.contains(&floor::first_fence()), "{lock}");
        assert!(!lock.contains("state"), "{lock}");
        let claim = CLAIMS.upsert(pg, "n", &holder(), Takeable::NotDone).sql;
        assert!(claim.starts_with("INSERT INTO freshlock_claim (name, state, owner, fence, expires_at, host, pid, label, claimed_at) VALUES ($1, 'processing', $2, 1, "), "{claim}");
        assert!(
            claim.contains(", state = 'processing' WHERE freshlock_claim.state <> 'done'"),
            "{claim}"
        );

        let take = LOCKS.take(DbBackend::MySql, "n", &holder(), Takeable::Expired);
        assert!(take.sql.ends_with("WHERE name = ? AND freshlock_lock.owner IS NOT NULL AND freshlock_lock.expires_at <= CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)"), "{}", take.sql);
        assert_eq!(
            take.values.map(|v| v.0.len()),
            Some(6),
            "holder's five, then the name"
        );

        let insert = LOCKS.insert_mysql("n", &holder()).sql;
        assert!(
            insert.contains(floor::MYSQL_FIRST_FENCE) && insert.ends_with(&floor::mysql_floor()),
            "{insert}"
        );
        let insert = CLAIMS.insert_mysql("n", &holder()).sql;
        assert!(
            insert.starts_with("INSERT IGNORE INTO freshlock_claim (name, state,")
                && insert.ends_with(")"),
            "{insert}"
        );
    }

    /// On MySQL every statement that can grant writes its fence with `LAST_INSERT_ID(expr)`:
    /// the grant reads it from the statement's own reply, with no `SELECT` after.
    #[test]
    fn mysql_grants_carry_their_fence_in_their_reply() {
        let take = LOCKS
            .take(DbBackend::MySql, "n", &holder(), Takeable::Free)
            .sql;
        assert!(
            take.contains("SET fence = LAST_INSERT_ID(fence + 1),"),
            "{take}"
        );
        let first = format!("LAST_INSERT_ID({})", floor::MYSQL_FIRST_FENCE);
        let insert = LOCKS.insert_mysql("n", &holder()).sql;
        assert!(insert.contains(&first), "{insert}");
        let insert = CLAIMS.insert_mysql("n", &holder()).sql;
        assert!(insert.contains("LAST_INSERT_ID(1)"), "{insert}");
        let take = LOCKS
            .take(DbBackend::Postgres, "n", &holder(), Takeable::Free)
            .sql;
        assert!(take.contains("SET fence = fence + 1,") && take.ends_with(" RETURNING fence"));
    }

    /// A grant that need not be durable by itself commits without waiting for its log flush on
    /// PostgreSQL, by both statements that can grant; never elsewhere, never when durable.
    #[test]
    fn only_a_checked_grant_on_postgres_skips_its_flush() {
        let relaxed = "set_config('synchronous_commit', 'off', true)";
        let checked = Holder {
            durable: false,
            ..holder()
        };
        for backend in [DbBackend::Postgres, DbBackend::Sqlite] {
            for h in [&holder(), &checked] {
                let upsert = LOCKS.upsert(backend, "n", h, Takeable::Free).sql;
                let take = LOCKS.take(backend, "n", h, Takeable::Expired).sql;
                let expected = backend == DbBackend::Postgres && !h.durable;
                for sql in [upsert, take] {
                    assert_eq!(sql.contains(relaxed), expected, "{sql}");
                    assert!(sql.contains(" RETURNING fence"), "{sql}");
                }
            }
        }
        let mysql = LOCKS
            .take(DbBackend::MySql, "n", &checked, Takeable::Free)
            .sql;
        assert!(!mysql.contains("set_config"), "{mysql}");
    }
}
