//! A short transaction of freshlock's own outside the engine — a claim and its finish, the
//! inspector's compaction, job admin, a fence bump, upkeep on MySQL/MariaDB: the one place where such a
//! transaction begins, bounds its round trips, is tried again after a deadlock and ends.
//!
//! Why one helper: each of these used to open its transaction by hand, and each got a
//! different subset of the rules (a claim bounded its round trips and retried deadlocks itself,
//! the inspector and job admin bounded nothing, so a silent partition froze them for hours).
//! The rules, once:
//! - `BEGIN` on a live connection, never cut in half (`live.rs`, `detach.rs`), waiting at most
//!   the reply bound;
//! - the work is handed the transaction as a [`Bounded`] connection: every round trip it sends
//!   waits at most the same bound;
//! - a deadlock (nothing was written) rolls back and runs the work again, at most
//!   [`DEADLOCK_TRIES`] times in all;
//! - any other failure ends the transaction without a second wait on a silent connection
//!   ([`rollback_after`]);
//! - the `COMMIT` waits at most the bound. A write that needs its lost `COMMIT` resolved commits
//!   with evidence instead (`commit::commit_write`), from the transaction [`Own::open`] returns.

use std::time::Duration;

use sea_orm::{DatabaseConnection, DatabaseTransaction, DbErr, TransactionOptions};
use tracing::{debug, warn};

use super::{
    deadline::{Bounded, Work, within},
    failure::{Failure, classify, is_no_reply},
};

/// How many times in all a transaction of its own runs when the database breaks a deadlock by
/// failing it: two claimants of one new key can deadlock on InnoDB's gap locks, and nothing was
/// written, so running again is safe.
pub(crate) const DEADLOCK_TRIES: u32 = 5;

/// A short transaction of freshlock's own on a pool (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct Own<'a> {
    db: &'a DatabaseConnection,
    options: TransactionOptions,
    reply: Duration,
}

impl<'a> Own<'a> {
    /// A transaction on `db` at the pool's default isolation, each round trip waiting at most
    /// `reply`.
    pub(crate) fn new(db: &'a DatabaseConnection, reply: Duration) -> Self {
        Self {
            db,
            options: TransactionOptions::default(),
            reply,
        }
    }

    /// The same, begun with `options`.
    pub(crate) fn with(self, options: TransactionOptions) -> Self {
        Self { options, ..self }
    }

    /// The bound on each round trip.
    pub(crate) fn reply(&self) -> Duration {
        self.reply
    }

    /// `BEGIN` on a live connection, never cut in half; past the bound the call fails as a lost
    /// connection and the `BEGIN` ends in a task of its own (see `detach.rs`).
    pub(crate) async fn begin(&self) -> Result<DatabaseTransaction, DbErr> {
        within(self.reply, super::live::begin(self.db, self.options)).await
    }

    /// Begins and runs `work` on the bounded transaction: the open transaction and what `work`
    /// returned, for the caller to commit (with evidence, or [`commit`](Self::commit)) or roll
    /// back. A deadlock rolls back and runs `work` again (see [`DEADLOCK_TRIES`]); any other
    /// failure ends the transaction and is returned.
    pub(crate) async fn open<T>(
        &self,
        mut work: impl for<'t> FnMut(&'t Bounded<'t, DatabaseTransaction>) -> Work<'t, T>,
    ) -> Result<(DatabaseTransaction, T), DbErr> {
        let mut tries = 0;
        loop {
            tries += 1;
            let txn = self.begin().await?;
            let bounded = Bounded::new(&txn, self.reply);
            let worked = work(&bounded).await;
            let silent = bounded.went_silent();
            match worked {
                Ok(value) => return Ok((txn, value)),
                Err(e) if tries < DEADLOCK_TRIES && classify(&e) == Failure::Deadlock => {
                    debug!(
                        tries,
                        "a transaction of freshlock's own met a deadlock: run again"
                    );
                    rollback(txn, self.reply).await;
                }
                Err(e) => {
                    rollback_after(txn, self.reply, silent || is_no_reply(&e)).await;
                    return Err(e);
                }
            }
        }
    }

    /// Commits `txn`, waiting at most the bound (a reply that does not come reads as a lost
    /// connection: in doubt, see `failure::in_doubt`).
    pub(crate) async fn commit(&self, txn: DatabaseTransaction) -> Result<(), DbErr> {
        within(self.reply, txn.commit()).await
    }

    /// [`open`](Self::open), then [`commit`](Self::commit): `work`'s value once committed.
    pub(crate) async fn run<T>(
        &self,
        work: impl for<'t> FnMut(&'t Bounded<'t, DatabaseTransaction>) -> Work<'t, T>,
    ) -> Result<T, DbErr> {
        let (txn, value) = self.open(work).await?;
        self.commit(txn).await?;
        Ok(value)
    }
}

/// Ends `txn` after a failure: rolled back as [`rollback`] does, or — when `silent`, a round
/// trip on it got no reply — dropped at once (which queues the rollback on its connection): a
/// second round trip on a connection gone silent would only wait out another bound.
pub(crate) async fn rollback_after(txn: DatabaseTransaction, reply: Duration, silent: bool) {
    if silent {
        debug!("no reply on the transaction's connection: dropped, not rolled back");
        drop(txn);
    } else {
        rollback(txn, reply).await;
    }
}

/// Rolls `txn` back, waiting at most `reply` (a connection whose reply does not come is dropped,
/// which queues the rollback on it). A failure is logged: the server ends the transaction with
/// the connection anyway.
pub(crate) async fn rollback(txn: DatabaseTransaction, reply: Duration) {
    if let Err(error) = within(reply, txn.rollback()).await {
        warn!(%error, "rollback failed");
    }
}
