//! Savepoints: what fails inside one leaves its transaction usable (PostgreSQL refuses every
//! statement of a transaction after a failed one). Every round trip of a savepoint —
//! `SAVEPOINT`, its statements, `RELEASE`, `ROLLBACK TO` — waits at most a reply's bound, as
//! every statement of a locked write does (see `deadline.rs`): a reply that never comes fails
//! as a lost connection, never hangs the transaction's locks.

use std::time::Duration;

use sea_orm::{DatabaseTransaction, DbErr, TransactionTrait};

use super::deadline::{Bounded, Work, within};

/// A savepoint of a transaction, its round trips bounded.
pub(crate) struct Savepoint {
    txn: DatabaseTransaction,
    reply: Duration,
}

impl Savepoint {
    /// `SAVEPOINT` in `txn`, every round trip of the savepoint bounded by `reply`.
    pub(crate) async fn begin(txn: &DatabaseTransaction, reply: Duration) -> Result<Self, DbErr> {
        let txn = within(reply, txn.begin()).await?;
        Ok(Self { txn, reply })
    }

    /// Runs `work` in a savepoint of `txn`: released when it succeeds, rolled back when it
    /// fails (the work's error is returned; a rollback that fails too ends the transaction
    /// anyway, which its next statement reports).
    pub(crate) async fn around<T>(
        txn: &DatabaseTransaction,
        reply: Duration,
        work: impl for<'c> FnOnce(&'c Bounded<'c, DatabaseTransaction>) -> Work<'c, T>,
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
    pub(crate) fn bounded(&self) -> Bounded<'_, DatabaseTransaction> {
        Bounded::new(&self.txn, self.reply)
    }

    /// Lends the savepoint's transaction to an owner (a job handler's `Tx`);
    /// [`resume`](Self::resume) takes it back.
    pub(crate) fn lend(self) -> DatabaseTransaction {
        self.txn
    }

    /// A lent savepoint, back (see [`lend`](Self::lend)).
    pub(crate) fn resume(txn: DatabaseTransaction, reply: Duration) -> Self {
        Self { txn, reply }
    }

    /// `RELEASE`: what was done in the savepoint stays in the transaction.
    pub(crate) async fn release(self) -> Result<(), DbErr> {
        within(self.reply, self.txn.commit()).await
    }

    /// `ROLLBACK TO`: what was done in the savepoint is undone; the transaction goes on.
    pub(crate) async fn roll_back(self) -> Result<(), DbErr> {
        within(self.reply, self.txn.rollback()).await
    }
}
