//! Savepoints: what fails inside one leaves its transaction usable (PostgreSQL refuses every
//! statement of a transaction after a failed one). Every round trip of a savepoint —
//! `SAVEPOINT`, its statements, `RELEASE`, `ROLLBACK TO` — waits at most a reply's bound, as
//! every statement of a locked write does (see `deadline.rs`): a reply that never comes fails
//! as a lost connection, never hangs the transaction's locks.

use std::time::Duration;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use sea_orm::ConnectionTrait;
use sea_orm::{DbErr, TransactionTrait};

use super::{
    deadline::{Bounded, Work, within},
    txn::Txn,
};

/// A savepoint's statements on a held connection (`held.rs`), where freshlock sends them itself:
/// the newest savepoint of that name is the one released or rolled back to — rolled back to,
/// then released (one message), as sea-orm's leaves none behind.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod held {
    pub(super) const BEGIN: &str = "SAVEPOINT freshlock_savepoint";
    pub(super) const RELEASE: &str = "RELEASE SAVEPOINT freshlock_savepoint";
    pub(super) const ROLL_BACK: &str =
        "ROLLBACK TO SAVEPOINT freshlock_savepoint; RELEASE SAVEPOINT freshlock_savepoint";
}

/// A savepoint of a transaction, its round trips bounded.
pub(crate) struct Savepoint {
    /// sea-orm's nested transaction; on a held connection, the transaction itself.
    txn: Txn,
    reply: Duration,
}

impl Savepoint {
    /// `SAVEPOINT` in `txn`, every round trip of the savepoint bounded by `reply`.
    pub(crate) async fn begin(txn: &Txn, reply: Duration) -> Result<Self, DbErr> {
        let txn = match txn {
            Txn::Sea(txn) => Txn::Sea(within(reply, txn.begin()).await?),
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Txn::Held(on) => {
                within(reply, on.execute_unprepared(held::BEGIN)).await?;
                Txn::Held(std::sync::Arc::clone(on))
            }
        };
        Ok(Self { txn, reply })
    }

    /// Runs `work` in a savepoint of `txn`: released when it succeeds, rolled back when it
    /// fails (the work's error is returned; a rollback that fails too ends the transaction
    /// anyway, which its next statement reports).
    pub(crate) async fn around<T>(
        txn: &Txn,
        reply: Duration,
        work: impl for<'c> FnOnce(&'c Bounded<'c, Txn>) -> Work<'c, T>,
    ) -> Result<T, DbErr> {
        let savepoint = Self::begin(txn, reply).await?;
        let done = work(&savepoint.bounded()).await;
        match done {
            Ok(value) => savepoint.release().await.map(|()| value),
            Err(error) => {
                let _ = savepoint.roll_back().await;
                Err(error)
            }
        }
    }

    /// The savepoint as a connection whose every round trip is bounded.
    pub(crate) fn bounded(&self) -> Bounded<'_, Txn> {
        Bounded::new(&self.txn, self.reply)
    }

    /// Lends the savepoint's transaction to an owner (a job handler's `Tx`);
    /// [`resume`](Self::resume) takes it back.
    pub(crate) fn lend(self) -> Txn {
        self.txn
    }

    /// A lent savepoint, back (see [`lend`](Self::lend)).
    pub(crate) fn resume(txn: Txn, reply: Duration) -> Self {
        Self { txn, reply }
    }

    /// `RELEASE`: what was done in the savepoint stays in the transaction.
    pub(crate) async fn release(self) -> Result<(), DbErr> {
        match self.txn {
            Txn::Sea(txn) => within(self.reply, txn.commit()).await,
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Txn::Held(on) => {
                (within(self.reply, on.execute_unprepared(held::RELEASE)).await).map(drop)
            }
        }
    }

    /// `ROLLBACK TO`: what was done in the savepoint is undone; the transaction goes on.
    pub(crate) async fn roll_back(self) -> Result<(), DbErr> {
        match self.txn {
            Txn::Sea(txn) => within(self.reply, txn.rollback()).await,
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            Txn::Held(on) => {
                (within(self.reply, on.execute_unprepared(held::ROLL_BACK)).await).map(drop)
            }
        }
    }
}
