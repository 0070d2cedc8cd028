//! Committing and rolling back a write's transaction: the evidence taken first, a lost reply
//! resolved, a failed transaction ended without waiting on a silent connection.

use std::time::Duration;

use sea_orm::{DatabaseTransaction, DbErr};
use tracing::warn;

use super::{
    evidence::Evidence,
    marker::sweep,
    resolve::{Resolution, unknown},
};
use crate::{
    db::{deadline::within, failure::in_doubt, own::rollback_after, pool::Pool},
    error::{Error, database},
};

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

/// Commits the transaction of a write. With `markers`, it first takes the evidence of its commit
/// ([`Evidence::take`]: the transaction id on PostgreSQL, a commit marker elsewhere), so a lost
/// reply is resolved (see the module docs); without, a lost reply is [`Error::CommitUnknown`].
///
/// Each round trip waits at most `reply` (see `deadline.rs`).
///
/// # Errors
/// As [`commit`]; [`Error::Database`] when the evidence cannot be taken (rolled back, nothing
/// committed — a missing `freshlock_commit` table means freshlock's migrations were not run).
pub(crate) async fn commit_write(
    txn: DatabaseTransaction,
    markers: bool,
    db: &Pool,
    target: &str,
    reply: Duration,
) -> Result<(), Error> {
    if !markers {
        return within(reply, txn.commit())
            .await
            .map_err(|e| write_error("committing", target, e));
    }
    let evidence = match within(reply, Evidence::take(&txn, db)).await {
        Ok(evidence) => evidence,
        Err(e) => {
            rollback_after(txn, reply, crate::db::failure::is_no_reply(&e)).await;
            return Err(database("marking the commit of", &target, e));
        }
    };
    commit(txn, &evidence, db, target, reply).await
}

/// What follows a commit that held `evidence`: a marker's writer sweeps old markers (see
/// `marker.rs`).
pub(crate) async fn committed(evidence: &Evidence, db: &Pool, reply: Duration) {
    if let Evidence::Marker(marker) = evidence {
        sweep(db, marker, reply).await;
    }
}

/// Commits `txn` (which holds `evidence`): `Ok` when it committed — also when the reply was lost
/// and the evidence shows the commit happened. For writes that take the evidence themselves (on
/// PostgreSQL, in the guarded UPDATE's own statement: one round trip less).
///
/// # Errors
/// - A transient [`Error::Database`] when the commit provably did not happen (run the write
///   again), or failed before it was sent.
/// - [`Error::CommitUnknown`] when the outcome cannot be resolved.
pub(crate) async fn commit(
    txn: DatabaseTransaction,
    evidence: &Evidence,
    db: &Pool,
    target: &str,
    reply: Duration,
) -> Result<(), Error> {
    // A reply that does not come within `reply` is a lost one (see `deadline.rs`).
    let lost = match within(reply, txn.commit()).await {
        Ok(()) => {
            committed(evidence, db, reply).await;
            return Ok(());
        }
        Err(e) if in_doubt(&e) => e,
        Err(e) => return Err(database("committing", &target, e)),
    };
    warn!(target, error = %lost, "the commit's reply was lost: resolving on another connection");
    match evidence.resolve(db, target, reply).await? {
        Resolution::Committed => Ok(()),
        // The lost connection, as it is: transient, so the write runs again.
        Resolution::Absent => Err(database("committing", &target, lost)),
    }
}
