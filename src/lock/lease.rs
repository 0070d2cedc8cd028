//! Holding a leased row, written once for every table whose rows freshlock leases: the `table`
//! backend's `freshlock_lock`, the claims' `freshlock_claim` and leased jobs' `freshlock_job`.
//!
//! A lease is an owner token and an expiry on the **database clock** in the row, with a fence
//! beside them where the table keeps one. Its holder checks it in the transaction of its write,
//! locking the row so that no takeover slips in before the commit ([`Leases::check`], or a
//! write whose `WHERE` is [`Leases::held`]), and moves the expiry on while it works
//! ([`Leases::extend`]). The owner token is new for every grant, so a token alone tells one
//! grant from the next; the fence is checked too where the table has one.
//!
//! What differs between the tables is said by their [`Leases`], not written again: how a lease
//! lapses ([`Lapse`]), the state a leased row is in, the column names. How a row is granted
//! differs by shape and stays where it is: a named row is inserted or taken by one statement
//! (`lease_row.rs`); a job is claimed by the take that already locked its row
//! (`jobs/store/lease.rs`). Leased jobs keep their lease in their own row rather than in
//! `freshlock_claim` because the job's state moves with it: an expired lease makes the job wait
//! again in the same statement that ends the lease, which a second table could not do.

use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Value};

use super::sql::{for_update, millis, now_ms, statement};
use crate::schema::{CLAIM_TABLE, LOCK_TABLE};

/// When a lease stops holding.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Lapse {
    /// At its expiry: a check or an extension after it fails (a lock: a writer past its TTL may
    /// be overlapping the next holder's write already).
    AtExpiry,
    /// When another holder takes the row (a claim, a leased job): an expired lease that nobody
    /// took over still holds, so a late finish of work nobody else did still lands.
    WhenTaken,
}

/// The leased rows of one table (see the module docs).
#[derive(Debug)]
pub(crate) struct Leases {
    pub(crate) table: &'static str,
    /// The row's key column.
    pub(crate) key: &'static str,
    /// The column holding the expiry (ms since the Unix epoch, database clock).
    pub(crate) expires: &'static str,
    /// A condition a leased row meets besides its owner (`""`: none).
    pub(crate) leased: &'static str,
    /// Whether the table keeps a fence that each grant raises.
    pub(crate) fence: bool,
    pub(crate) lapse: Lapse,
}

/// `freshlock_lock`: the `table` backend's leases, which end at their expiry.
pub(crate) const LOCK_LEASES: Leases = Leases {
    table: LOCK_TABLE,
    key: "name",
    expires: "expires_at",
    leased: "",
    fence: true,
    lapse: Lapse::AtExpiry,
};

/// `freshlock_claim`: claims, which hold until taken over.
pub(crate) const CLAIM_LEASES: Leases = Leases {
    table: CLAIM_TABLE,
    key: "name",
    expires: "expires_at",
    leased: "state = 'processing'",
    fence: true,
    lapse: Lapse::WhenTaken,
};

/// The holder of one leased row: the row's key, the grant's owner token and, where the table
/// keeps one, its fence.
#[derive(Clone, Debug)]
pub(crate) struct Held<'a> {
    pub(crate) key: Value,
    pub(crate) owner: &'a str,
    pub(crate) fence: Option<i64>,
}

impl Leases {
    /// The condition that the row is still leased to its holder, with `?` for its values in
    /// order: the key, the owner token, the fence (where the table keeps one).
    pub(crate) fn held(&self, backend: DbBackend) -> String {
        let mut sql = format!("{} = ? AND owner = ?", self.key);
        if self.fence {
            sql.push_str(" AND fence = ?");
        }
        if !self.leased.is_empty() {
            sql.push_str(" AND ");
            sql.push_str(self.leased);
        }
        if self.lapse == Lapse::AtExpiry {
            sql.push_str(&format!(" AND {} > {}", self.expires, now_ms(backend)));
        }
        sql
    }

    /// The values of [`held`](Self::held) for `holder`.
    pub(crate) fn values(&self, holder: &Held<'_>) -> Vec<Value> {
        let mut values = vec![holder.key.clone(), holder.owner.into()];
        if self.fence {
            values.push(holder.fence.unwrap_or_default().into());
        }
        values
    }

    /// Whether `holder` still holds its lease, checked in `conn`'s transaction and locking the
    /// row until it ends (off SQLite, whose `BEGIN IMMEDIATE` excludes every other writer
    /// already): a takeover waits for the commit, so the lease cannot be lost between this
    /// check and the write it guards.
    ///
    /// # Errors
    /// The database's.
    pub(crate) async fn check(
        &self,
        conn: &impl ConnectionTrait,
        holder: &Held<'_>,
    ) -> Result<bool, DbErr> {
        let backend = conn.get_database_backend();
        let sql = format!(
            "SELECT {key} FROM {table} WHERE {held}{lock}",
            key = self.key,
            table = self.table,
            held = self.held(backend),
            lock = for_update(backend),
        );
        let row = conn
            .query_one_raw(statement(backend, &sql, self.values(holder)))
            .await?;
        Ok(row.is_some())
    }

    /// Moves `holder`'s lease to expire `ttl` from now (a heartbeat): `false` when it no longer
    /// holds. One statement, which commits alone on `conn` when that is a pool.
    ///
    /// # Errors
    /// The database's.
    pub(crate) async fn extend(
        &self,
        conn: &impl ConnectionTrait,
        holder: &Held<'_>,
        ttl: Duration,
    ) -> Result<bool, DbErr> {
        let backend = conn.get_database_backend();
        let sql = format!(
            "UPDATE {table} SET {expires} = {now} + ? WHERE {held}",
            table = self.table,
            expires = self.expires,
            now = now_ms(backend),
            held = self.held(backend),
        );
        let mut values = vec![millis(ttl).into()];
        values.extend(self.values(holder));
        let done = conn.execute_raw(statement(backend, &sql, values)).await?;
        Ok(done.rows_affected() == 1)
    }
}

/// A held lease's check and release (`table`'s `verify_and_release_in`): frees the lease row
/// of name `?` where it still has owner `?`, fence `?` and an expiry in the future, keeping it
/// locked until the transaction ends. One row changed: the lease was still held.
pub(crate) fn lease_free(backend: DbBackend) -> String {
    let held = LOCK_LEASES.held(backend);
    format!("UPDATE {LOCK_TABLE} SET owner = NULL, expires_at = 0 WHERE {held}")
}

/// The values of [`lease_free`] for a lease's row: its (stored) name, its owner token and the
/// grant's fence.
pub(crate) fn lease_values(name: &str, owner: &str, fence: i64) -> [Value; 3] {
    [name.into(), owner.into(), fence.into()]
}

/// [`lease_free`] on MySQL/MariaDB with its `values` ([`lease_values`]) written into the text
/// (see `inline.rs`), to ride in a message of several statements (see
/// [`crate::lock::Fencing::owned_row`]); `None` when a value cannot be written in.
#[cfg(feature = "mysql")]
pub(crate) fn lease_free_written(values: [Value; 3]) -> Option<String> {
    crate::db::inline::mysql::written(&lease_free(DbBackend::MySql), values)
}

/// [`lease_free`] as a data-modifying `WITH` before a PostgreSQL statement whose own values are
/// `$1` to `$first - 1` (see [`crate::lock::Fencing::owned_row`]): `freed` has a row when the
/// lease was still held, and this statement's transaction then frees it. PostgreSQL runs the
/// `UPDATE` once, whether or not the statement reads `freed`.
pub(crate) fn lease_freed(first: u32) -> String {
    let free = super::sql::numbered(&lease_free(DbBackend::Postgres), first);
    format!("WITH freed AS ({free} RETURNING 1) ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three tables' conditions, from one definition: a lock's lapses at its expiry, a
    /// claim's and a job's hold until taken over; the fence where the table keeps one.
    #[test]
    fn every_table_checks_its_lease_by_the_same_condition() {
        let pg = DbBackend::Postgres;
        assert_eq!(
            LOCK_LEASES.held(pg),
            format!(
                "name = ? AND owner = ? AND fence = ? AND expires_at > {}",
                now_ms(pg)
            )
        );
        assert_eq!(
            CLAIM_LEASES.held(pg),
            "name = ? AND owner = ? AND fence = ? AND state = 'processing'"
        );
        let holder = Held {
            key: "n".into(),
            owner: "t",
            fence: Some(7),
        };
        assert_eq!(
            CLAIM_LEASES.values(&holder),
            vec![Value::from("n"), Value::from("t"), Value::from(7_i64)]
        );
    }

    /// The check-and-free written into a MySQL message is the bound statement's text with its
    /// three values in place: the name and the token as hexadecimal literals (whatever they
    /// hold), the fence as a number.
    #[cfg(feature = "mysql")]
    #[test]
    fn a_written_lease_check_is_the_bound_text_with_its_values() {
        let text = lease_free_written(lease_values("it's ?", "ab", -3)).expect("written");
        let expected = lease_free(DbBackend::MySql)
            .replacen('?', "_utf8mb4 X'69742773203F'", 1)
            .replacen('?', "_utf8mb4 X'6162'", 1)
            .replacen('?', "-3", 1);
        assert_eq!(text, expected);
        assert!(!text.contains('?'), "{text}");
    }
}
