//! The Django report's `HamLock`: a lock row per name, locked inside the transaction.

use std::time::Duration;

use async_trait::async_trait;
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend};

use super::{
    LocalLock,
    name::LockName,
    sql::{lock_error, statement},
    traits::TransactionLock,
    wait::with_lock_timeout,
};
use crate::{
    error::LockError,
    schema::{MAX_STORED_NAME, ROW_LOCK_TABLE, insert_ignore},
};

const KIND: &str = "row";

/// Locks a row of `freshlock_row_lock` (one per lock name, created on demand) with
/// `SELECT … FOR UPDATE` (`FOR NO KEY UPDATE` on PostgreSQL) inside the `locked_update`
/// transaction, instead of the data row or its parent: the Django report's `HamLock`. Readers and
/// writers of the parent row never wait for it. The lock ends with the transaction, so a crashed
/// holder frees it at once, and there is nothing to fence. On PostgreSQL a `locked_update` tries
/// the lock row in its reload's own statement (no statement of its own while the row exists and
/// is free; a busy one is waited for by a second try that locks it with statements of its own).
///
/// On **SQLite** there are no row locks: `BEGIN IMMEDIATE`, which every `locked_update` uses, lets
/// one writer at a time into the whole database, and that is what serializes. This backend then
/// sends nothing.
///
/// Not on a **MariaDB Galera cluster**: a row lock there is local to the node that took it, so
/// writers on two nodes would both hold it ([`crate::LockKind::connect`] refuses `row` on a
/// cluster; `RowLock::new` does not check). Use `table` or `redis` there.
///
/// Needs [`crate::schema::Migration`]. Lock rows are created on demand inside the locking
/// transaction (the insert is the lock), so the section needs no second connection of its pool,
/// and a section that rolls back leaves no lock row. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RowLock {
    _rows: DatabaseConnection,
    /// This backend's in-process queue (see [`LockBackend::queue`]), shared by its clones.
    queue: LocalLock,
}

impl RowLock {
    /// Lock rows in `rows`' database (the data's). Every statement runs in the section's own
    /// transaction; `rows` names the database and is not used for statements of its own.
    pub fn new(rows: DatabaseConnection) -> Self {
        Self {
            _rows: rows,
            queue: LocalLock::new(),
        }
    }

    /// The `name` column of lock `name`'s row.
    pub(crate) fn stored_name(name: &LockName) -> String {
        name.bounded(MAX_STORED_NAME, false).into_owned()
    }

    /// The condition that locks lock row `stored` (see [`Self::stored_name`]) on PostgreSQL
    /// when it exists and no other transaction holds it, for a statement's `WHERE` (`$1`: the
    /// name): an uncorrelated sub-select, so a one-time filter evaluated before the statement
    /// reads or locks any row of its own. False when the row is missing or held; it never
    /// waits.
    pub(crate) const FOLDED: &'static str = "EXISTS (SELECT 1 FROM freshlock_row_lock \
         WHERE name = $1 FOR NO KEY UPDATE SKIP LOCKED)";

    /// [`Self::FOLDED`] on MySQL/MariaDB (10.6 and later have `SKIP LOCKED`; a subquery's own
    /// locking clause locks its rows there).
    pub(crate) const FOLDED_MYSQL: &'static str = "EXISTS (SELECT 1 FROM freshlock_row_lock \
         WHERE name = ? FOR UPDATE SKIP LOCKED)";

    /// The folded try of `backend`.
    pub(crate) fn folded(backend: DbBackend) -> &'static str {
        if backend == DbBackend::MySql {
            Self::FOLDED_MYSQL
        } else {
            Self::FOLDED
        }
    }
}

super::outside::outside_backend!(RowLock, Row, Transaction);

#[async_trait]
impl TransactionLock for RowLock {
    async fn lock_in_transaction(
        &self,
        txn: &DatabaseTransaction,
        name: &LockName,
        wait: Duration,
    ) -> Result<bool, LockError> {
        let backend = txn.get_database_backend();
        if backend == DbBackend::Sqlite {
            return Ok(true);
        }
        let fail = |e| lock_error(KIND, ROW_LOCK_TABLE, e);
        let stored = Self::stored_name(name);
        let row_lock = if backend == DbBackend::Postgres {
            "FOR NO KEY UPDATE"
        } else {
            "FOR UPDATE"
        };
        let skip =
            format!("SELECT name FROM {ROW_LOCK_TABLE} WHERE name = ? {row_lock} SKIP LOCKED");
        let skip = statement(backend, &skip, vec![stored.clone().into()]);
        // On PostgreSQL a locking read of a missing row locks nothing, so try the one-statement
        // fast path at once. InnoDB under REPEATABLE READ gap-locks a missing row on a locking
        // read (blocking our own insert of it) and takes a shared lock on a duplicate insert
        // (waiting for the holder): there, look without locking first.
        let exists = if backend == DbBackend::Postgres {
            None
        } else {
            let exists = format!("SELECT name FROM {ROW_LOCK_TABLE} WHERE name = ?");
            let exists = statement(backend, &exists, vec![stored.clone().into()]);
            Some(txn.query_one_raw(exists).await.map_err(fail)?.is_some())
        };
        if exists != Some(false)
            && txn
                .query_one_raw(skip.clone())
                .await
                .map_err(fail)?
                .is_some()
        {
            return Ok(true);
        }
        // A compaction (`inspect::compact`) may delete the row while we wait for it: then the
        // locking read finds nothing, and the row is created again (bounded: a few rounds).
        let mut create = exists != Some(true);
        for _ in 0..3 {
            if create {
                // Missing (or, on PostgreSQL, maybe held): create it in this transaction. A row
                // we insert stays locked by us until we end, so inserting it *is* taking the
                // lock; a concurrent creator's uncommitted insert makes ours wait, bounded like
                // any lock wait. No second connection of the pool is needed (a pool of 1
                // works), and a transaction that rolls back — an update whose row turned out
                // missing — leaves no lock row behind.
                // MySQL/MariaDB: `ON DUPLICATE KEY UPDATE` takes the exclusive lock on a row a
                // concurrent creator made (where `INSERT IGNORE` takes a shared one, and two
                // shared holders upgrading to exclusive deadlock), so either way this statement
                // takes the lock. PostgreSQL: `ON CONFLICT DO NOTHING` locks nothing on a
                // conflict; the locking read below does.
                let insert = if backend == DbBackend::MySql {
                    format!(
                        "INSERT INTO {ROW_LOCK_TABLE} (name) VALUES (?) \
                         ON DUPLICATE KEY UPDATE name = name"
                    )
                } else {
                    insert_ignore(backend, ROW_LOCK_TABLE, "name", "?")
                };
                let insert = statement(backend, &insert, vec![stored.clone().into()]);
                let inserted = with_lock_timeout(txn, wait, async {
                    txn.execute_raw(insert)
                        .await
                        .map(|done| done.rows_affected())
                })
                .await
                .map_err(fail)?;
                match inserted {
                    None => return Ok(false),
                    Some(_) if backend == DbBackend::MySql => return Ok(true),
                    Some(1) => return Ok(true),
                    Some(_) => {} // Created meanwhile by another transaction: lock it below.
                }
            }
            if wait.is_zero() {
                return Ok(txn.query_one_raw(skip).await.map_err(fail)?.is_some());
            }
            let blocking = format!("SELECT name FROM {ROW_LOCK_TABLE} WHERE name = ? {row_lock}");
            let blocking = statement(backend, &blocking, vec![stored.clone().into()]);
            let locked = with_lock_timeout(txn, wait, async {
                txn.query_one_raw(blocking.clone())
                    .await
                    .map(|row| row.is_some())
            })
            .await
            .map_err(fail)?;
            match locked {
                None => return Ok(false),
                Some(true) => return Ok(true),
                // Deleted while we waited: create it again.
                Some(false) => create = true,
            }
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_folded_try_locks_the_lock_table_without_waiting() {
        let table = format!("FROM {ROW_LOCK_TABLE} ");
        assert!(RowLock::FOLDED.contains(&table), "{}", RowLock::FOLDED);
        assert!(RowLock::FOLDED.ends_with("FOR NO KEY UPDATE SKIP LOCKED)"));
    }
}
