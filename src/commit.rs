//! Commits whose reply was lost: never applied twice.
//!
//! When the connection breaks while `COMMIT` is in flight, the transaction may or may not have
//! committed, and running the write again would apply it twice if it had. So every locked write
//! inserts a **commit marker** — a row with a token no other write has — into `freshlock_commit`
//! in its own transaction, just before `COMMIT`. If the reply is lost, the outcome is resolved on
//! another connection by inserting the *same* token:
//!
//! - the insert fails on the key and the row is the writer's → the write committed: report it;
//! - the insert succeeds → the write did not commit, and now never can (its own insert of the
//!   token would fail): it is provably absent and safe to run again. The resolver's row is
//!   marked as its own (`created_at = 0`), because its insert can lose its reply too: a retried
//!   resolution that finds its own row knows the write is absent, not committed;
//! - while the old transaction is still finishing on the server, the insert waits for it (a
//!   unique-key check waits for the transaction that inserted the same key, on PostgreSQL,
//!   InnoDB and SQLite alike), so the answer is never read too early.
//!
//! If the database does not answer within [`RESOLVE_WITHIN`], the outcome stays unknown and the
//! caller gets [`Error::CommitUnknown`] — never a second `apply`. A marker is one short INSERT in
//! the transaction that commits anyway (no extra flush); markers older than [`KEEP_MARKERS`] are
//! deleted now and then by the writers themselves.
//!
//! On PostgreSQL, `locked_update`'s marker rides in the guarded UPDATE's own statement (a
//! data-modifying CTE, `WITH freshlock_marker AS (INSERT …) UPDATE …`): no round trip of its
//! own. The transaction's id (`txid_current()` / `txid_status`) is **not** used as evidence: a
//! transaction whose WAL never reached disk before a crash leaves no trace of its id, and after
//! crash recovery the server hands the same id to a new transaction — once that one commits,
//! `txid_status` says `committed` for a write that never was (measured: 8 of 8 tries after a
//! `kill -9` of a backend). A marker row is durable exactly when the write is: it is in the
//! same transaction, so crash recovery keeps both or neither.
//!
//! Why a token rather than the version column or the lease's fence: both can be moved on by a
//! later writer (an ABA: version v+1 may be someone else's write from v when ours did not
//! commit), so they cannot prove that *this* write committed. A token can.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr,
    sea_query::{ExprTrait, Query},
};
use tracing::{info, warn};

use crate::{
    db_error::{classify, in_doubt},
    deadline::within,
    error::{Error, database},
    lock::holder,
    pool::autocommit,
    schema::COMMIT_TABLE,
};

/// How long a lost commit reply is resolved for (the database may be restarting) before the
/// outcome is reported as unknown.
pub(crate) const RESOLVE_WITHIN: Duration = Duration::from_secs(30);

/// How long markers are kept: far longer than any resolution takes.
pub(crate) const KEEP_MARKERS: Duration = Duration::from_secs(600);

/// Every this many markers a process writes, it deletes the expired ones.
const SWEEP_EVERY: u64 = 1024;

/// What a lost commit reply turned out to be.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Resolution {
    /// The write committed.
    Committed,
    /// The write did not commit and never will: running it again is safe.
    Absent,
}

/// One write's commit marker.
#[derive(Debug)]
pub(crate) struct Marker {
    token: String,
}

impl Marker {
    pub(crate) fn new() -> Self {
        Self {
            token: holder::new_token(),
        }
    }

    /// The marker's INSERT: the writer's, stamped with the database clock, or the resolver's
    /// (`created_at = 0`).
    pub(crate) fn insert(
        &self,
        backend: sea_orm::DbBackend,
        writer: bool,
    ) -> sea_orm::sea_query::InsertStatement {
        let now = if writer {
            crate::lock::sql::now_ms(backend)
        } else {
            "0"
        };
        Query::insert()
            .into_table(sea_orm::sea_query::Alias::new(COMMIT_TABLE))
            .columns([
                sea_orm::sea_query::Alias::new("token"),
                sea_orm::sea_query::Alias::new("created_at"),
            ])
            // Two columns, two values: `values_panic` cannot panic here.
            .values_panic([
                self.token.clone().into(),
                sea_orm::sea_query::Expr::cust(now),
            ])
            .to_owned()
    }

    /// Writes the marker in the write's transaction, just before its `COMMIT`.
    pub(crate) async fn write(&self, txn: &DatabaseTransaction) -> Result<(), DbErr> {
        txn.execute(&self.insert(txn.get_database_backend(), true))
            .await
            .map(drop)
    }

    /// After a lost commit reply: whether the write committed, on another connection of `db`.
    ///
    /// # Errors
    /// [`Error::CommitUnknown`] when no answer could be had within [`RESOLVE_WITHIN`].
    /// Each attempt waits at most `reply` (a resolver's connection can be cut off too): one
    /// without an answer is tried again on another connection, until [`RESOLVE_WITHIN`].
    pub(crate) async fn resolve(
        &self,
        db: &DatabaseConnection,
        target: &str,
        reply: Duration,
    ) -> Result<Resolution, Error> {
        let backend = db.get_database_backend();
        let insert = self.insert(backend, false);
        let pool = db;
        let db = &autocommit(db);
        let deadline = tokio::time::Instant::now() + RESOLVE_WITHIN;
        let mut delay = Duration::from_millis(20);
        loop {
            let attempt = deadline.min(tokio::time::Instant::now() + reply);
            let tried = tokio::time::timeout_at(attempt, db.execute(&insert)).await;
            let error = match tried {
                Ok(Ok(_)) => {
                    info!(target, token = %self.token, "lost commit reply: the write did not commit; running it again");
                    return Ok(Resolution::Absent);
                }
                Ok(Err(e)) if crate::db_error::is_unique_violation(&e) => {
                    match within(reply, self.written_by_writer(pool)).await {
                        Ok(Some(true)) => {
                            info!(target, token = %self.token, "lost commit reply: the write committed");
                            return Ok(Resolution::Committed);
                        }
                        Ok(Some(false)) => {
                            info!(target, token = %self.token, "lost commit reply: the write did not commit (found our own resolution)");
                            return Ok(Resolution::Absent);
                        }
                        // Gone since the insert failed: only our own resolution's row can be
                        // swept that soon (a writer's is minutes younger than the sweep's
                        // cutoff), so try again at once.
                        Ok(None) => continue,
                        Err(e) => e,
                    }
                }
                Ok(Err(e)) if classify(&e).is_transient() => e,
                Ok(Err(e)) => return Err(unknown(target, Box::new(e))),
                Err(_) if attempt < deadline => crate::deadline::no_reply(reply),
                Err(_) => return Err(unknown(target, "no answer from the database".into())),
            };
            warn!(target, %error, "lost commit reply: the database is not answering yet");
            if tokio::time::Instant::now() + delay >= deadline {
                return Err(unknown(target, Box::new(error)));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(250));
        }
    }
}

/// The error of a write that may have reached the database without a marker (an autocommit
/// statement, a commit without marker): [`Error::CommitUnknown`] when the connection was lost
/// while it was in flight, else [`Error::Database`].
pub(crate) fn write_error(operation: &'static str, target: &str, e: DbErr) -> Error {
    if in_doubt(&e) {
        unknown(target, Box::new(e))
    } else {
        database(operation, &target, e)
    }
}

impl Marker {
    /// Whether the marker row is the writer's, not an earlier resolution's; `None` when there
    /// is no row (any more).
    async fn written_by_writer(&self, db: &DatabaseConnection) -> Result<Option<bool>, DbErr> {
        let select = Query::select()
            .column(sea_orm::sea_query::Alias::new("created_at"))
            .from(sea_orm::sea_query::Alias::new(COMMIT_TABLE))
            .and_where(ExprTrait::eq(
                sea_orm::sea_query::Expr::col(sea_orm::sea_query::Alias::new("token")),
                self.token.as_str(),
            ))
            .to_owned();
        let Some(row) = autocommit(db).query_one(&select).await? else {
            return Ok(None);
        };
        Ok(Some(row.try_get::<i64>("", "created_at")? != 0))
    }
}

fn unknown(target: &str, source: crate::error::BoxError) -> Error {
    Error::CommitUnknown {
        target: target.to_owned(),
        source,
    }
}

/// Commits the transaction of a write. With `markers`, it first writes a commit marker, so a
/// lost reply is resolved (see the module docs); without, a lost reply is
/// [`Error::CommitUnknown`].
///
/// Each round trip waits at most `reply` (see `deadline.rs`).
///
/// # Errors
/// As [`commit`]; [`Error::Database`] when the marker cannot be written (rolled back, nothing
/// committed — a missing `freshlock_commit` table means freshlock's migrations were not run).
pub(crate) async fn commit_write(
    txn: DatabaseTransaction,
    markers: bool,
    db: &DatabaseConnection,
    target: &str,
    reply: Duration,
) -> Result<(), Error> {
    if !markers {
        return within(reply, txn.commit())
            .await
            .map_err(|e| write_error("committing", target, e));
    }
    let marker = Marker::new();
    if let Err(e) = within(reply, marker.write(&txn)).await {
        rollback(txn, reply).await;
        return Err(database("marking the commit of", &target, e));
    }
    commit(txn, &marker, db, target, reply).await
}

/// Rolls `txn` back, waiting at most `reply` (a connection whose reply does not come is dropped,
/// which queues the rollback on it). A failure is logged: the server ends the transaction with
/// the connection anyway.
pub(crate) async fn rollback(txn: DatabaseTransaction, reply: Duration) {
    if let Err(error) = within(reply, txn.rollback()).await {
        warn!(%error, "rollback failed");
    }
}

/// Commits `txn` (which holds `marker`): `Ok` when it committed — also when the reply was lost
/// and the marker shows the commit happened. For writes that put the marker in the transaction
/// themselves (on PostgreSQL, in the guarded UPDATE's own statement: one round trip less).
///
/// # Errors
/// - A transient [`Error::Database`] when the commit provably did not happen (run the write
///   again), or failed before it was sent.
/// - [`Error::CommitUnknown`] when the outcome cannot be resolved.
pub(crate) async fn commit(
    txn: DatabaseTransaction,
    marker: &Marker,
    db: &DatabaseConnection,
    target: &str,
    reply: Duration,
) -> Result<(), Error> {
    // A reply that does not come within `reply` is a lost one (see `deadline.rs`).
    let lost = match within(reply, txn.commit()).await {
        Ok(()) => {
            sweep(db, marker).await;
            return Ok(());
        }
        Err(e) if in_doubt(&e) => e,
        Err(e) => return Err(database("committing", &target, e)),
    };
    warn!(target, error = %lost, "the commit's reply was lost: resolving on another connection");
    match marker.resolve(db, target, reply).await? {
        Resolution::Committed => Ok(()),
        // The lost connection, as it is: transient, so the write runs again.
        Resolution::Absent => Err(database("committing", &target, lost)),
    }
}

/// Now and then (every [`SWEEP_EVERY`] markers of this process) deletes the markers older than
/// [`KEEP_MARKERS`]. A failure is logged: it only leaves rows for the next sweep.
async fn sweep(db: &DatabaseConnection, marker: &Marker) {
    static WRITTEN: AtomicU64 = AtomicU64::new(0);
    if WRITTEN.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY != SWEEP_EVERY - 1 {
        return;
    }
    let backend = db.get_database_backend();
    let cutoff = format!(
        "{} - {}",
        crate::lock::sql::now_ms(backend),
        KEEP_MARKERS.as_millis()
    );
    let delete = Query::delete()
        .from_table(sea_orm::sea_query::Alias::new(COMMIT_TABLE))
        .and_where(sea_orm::sea_query::Expr::cust(format!(
            "created_at < {cutoff}"
        )))
        .to_owned();
    if let Err(error) = autocommit(db).execute(&delete).await {
        warn!(%error, token = %marker.token, "deleting old commit markers failed");
    }
}
