//! The lock backend traits: what a backend is ([`LockBackend`], its [`LockRole`]), how it locks
//! ([`LeaseLock`], [`TransactionLock`]) and what it hands back ([`LockGuard`]). Every backend
//! implements these; none of them knows a backend.
//!
//! [`LocalLock`]: super::LocalLock

use std::{fmt, time::Duration};

use async_trait::async_trait;
use sea_orm::DatabaseTransaction;

use super::{kind::LockKind, name::LockName};
use crate::error::LockError;

/// When a backend's lock is taken and when it ends.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockScope {
    /// Taken before the transaction begins, released after it ends ([`LeaseLock::acquire`]).
    Lease,
    /// Taken inside the transaction and released by its commit or rollback
    /// ([`TransactionLock::lock_in_transaction`]).
    Transaction,
}

/// A pluggable lock backend.
///
/// Implementations are shared (`Arc<dyn LockBackend>`) by every session that should exclude the
/// others, so they must be cheap to call concurrently.
///
/// Used through `Arc<dyn LockBackend>`, so a session can be given any backend chosen at run
/// time. Backends come in two scopes ([`LockScope`]):
///
/// - **lease** locks are taken *before* the transaction opens and released *after* it commits
///   (the in-process [`LocalLock`](super::LocalLock); a lock table, Redis or MySQL `GET_LOCK` fit here too): such a
///   backend implements [`LeaseLock`] and answers [`LockRole::Lease`]. Their [`LockGuard`] is
///   released explicitly with [`LockGuard::release`].
/// - **transaction** locks are taken *inside* the transaction and end with it
///   (`SELECT … FOR UPDATE` on a lock row, `pg_advisory_xact_lock`): such a backend implements
///   [`TransactionLock`], answers [`LockRole::Transaction`] and has nothing to release.
///
/// A backend implements exactly the half it has: [`role`](LockBackend::role) hands the session
/// that half, so there is no stub of the other one to get wrong.
///
/// How often to try, how long to wait and what to do when the lock cannot be had is the caller's
/// [`LockPolicy`](super::LockPolicy), applied by the session — backends only try once, waiting at most the time they
/// are given.
pub trait LockBackend: Send + Sync + fmt::Debug {
    /// Which backend this is, for logs, reports and metrics: one of freshlock's, or
    /// [`LockKind::Other`] with a short name for a backend of the application's own.
    fn kind(&self) -> LockKind;

    /// Whether this backend's lock already excludes the tasks of this process from each other
    /// by itself, in-process (the [`LocalLock`](super::LocalLock)): then sessions do not queue its waiters
    /// in-process first. Every backend that reaches outside the process keeps the default,
    /// `false`, and gets that queue, so at most one task per key and process waits on (and holds
    /// a connection for) the shared lock.
    fn in_process(&self) -> bool {
        false
    }

    /// The in-process queue this backend's waiters of one process line up in before they reach
    /// the shared lock, so that at most one task per key and process waits on (and polls, or
    /// holds a connection for) it: many waiters on one hot key cannot drain the connection pool,
    /// and writes queued there may share a commit ([`crate::SessionBuilder::combine_commits`]).
    ///
    /// The queue belongs to the backend: every one of freshlock's backends that reaches outside
    /// the process keeps a [`LocalLock`](super::LocalLock) of its own, shared by its clones, and
    /// returns it here, so every session given the backend (in whichever `Arc`) queues in it. A
    /// backend of your own does the same — keep a `LocalLock` made once with the backend and
    /// return `Some(&self.queue)`; the default, `None`, queues nothing in process. Backends
    /// that are in-process themselves ([`in_process`](Self::in_process)) need none.
    fn queue(&self) -> Option<&dyn LockBackend> {
        None
    }

    /// The in-process lock space this backend *is*, when it is one: [`LocalLock`](super::LocalLock) returns its
    /// id (every clone of one `LocalLock` has the same); every other backend keeps the default,
    /// `None`. Sessions use it to tell which writes of the process exclude each other through
    /// one lock space, whichever `Arc` each session was given it in: those writes may share a
    /// commit ([`crate::SessionBuilder::combine_commits`]).
    fn lock_space(&self) -> Option<u64> {
        None
    }

    /// The lock this backend takes: a lease around the transaction or a lock inside it.
    fn role(&self) -> LockRole<'_>;
}

impl dyn LockBackend + '_ {
    /// Whether this backend's lock is a lease around the transaction or lives inside it.
    pub fn scope(&self) -> LockScope {
        match self.role() {
            LockRole::Lease(_) => LockScope::Lease,
            LockRole::Transaction(_) => LockScope::Transaction,
        }
    }

    /// For callers holding any backend: [`LeaseLock::acquire`] of a lease backend; a
    /// transaction backend has no lease to give (`Ok(None)`, at once).
    ///
    /// # Errors
    /// As [`LeaseLock::acquire`].
    pub async fn acquire(&self, name: &LockName, wait: Duration, ttl: Duration) -> Acquired {
        match self.role() {
            LockRole::Lease(lease) => lease.acquire(name, wait, ttl).await,
            LockRole::Transaction(_) => Ok(None),
        }
    }

    /// For callers holding any backend: [`TransactionLock::lock_in_transaction`] of a
    /// transaction backend; a lease backend takes nothing inside the transaction (`Ok(false)`).
    ///
    /// # Errors
    /// As [`TransactionLock::lock_in_transaction`].
    pub async fn lock_in_transaction(
        &self,
        txn: &DatabaseTransaction,
        name: &LockName,
        wait: Duration,
    ) -> Result<bool, LockError> {
        match self.role() {
            LockRole::Transaction(lock) => lock.lock_in_transaction(txn, name, wait).await,
            LockRole::Lease(_) => Ok(false),
        }
    }
}

/// The half of the locking a [`LockBackend`] implements (see [`LockBackend::role`]).
#[derive(Clone, Copy)]
pub enum LockRole<'a> {
    /// A lease taken before the transaction and released after it.
    Lease(&'a dyn LeaseLock),
    /// A lock taken inside the transaction, ended by it.
    Transaction(&'a dyn TransactionLock),
}

impl fmt::Debug for LockRole<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Lease(_) => "Lease",
            Self::Transaction(_) => "Transaction",
        })
    }
}

/// What asking for a lease gives: `Ok(Some(guard))` when it was granted, `Ok(None)` when
/// someone else held it for the whole wait (an expected outcome, not an error), and
/// [`LockError`] when the backend itself failed.
pub type Acquired = Result<Option<Box<dyn LockGuard>>, LockError>;

/// A lease lock: taken before the transaction opens, released after it ends.
#[async_trait]
pub trait LeaseLock: Send + Sync {
    /// Takes the lease lock `name`, waiting at most `wait` (zero: try once, don't wait).
    ///
    /// `ttl` is how long the lease may live if its holder disappears; backends whose locks cannot
    /// outlive their holder (the in-process lock) ignore it.
    ///
    /// Returns `Ok(None)` when the lock is held by someone else for the whole wait: that is an
    /// expected outcome, not an error.
    ///
    /// # Errors
    /// [`LockError`] when the backend itself fails (server unreachable, bad name).
    ///
    /// # Cancel safety
    /// Dropping the future while it waits gives up the wait and leaves no lock behind.
    async fn acquire(&self, name: &LockName, wait: Duration, ttl: Duration) -> Acquired;

    /// [`acquire`](Self::acquire), for a caller that acts under the lease only in transactions
    /// on the database whose rows it guards, each checking the lease before it commits
    /// ([`Fencing::verify`], [`Fencing::fence_row`]) unless all it writes is new rows (which
    /// the key refuses to a second writer), and that shows the grant's fence to nobody before
    /// such a transaction has ended — as `locked_update`, `locked_delete`, `get_or_insert` and
    /// sections do (their [`LockReport`](crate::LockReport) comes after). Such a grant need not
    /// be durable by itself: one lost with a crash of the database fails every later check (its
    /// token is in no row), and a transaction that commits after it makes it durable too where
    /// the database flushes its log in order (PostgreSQL). [`TableLock`](super::TableLock)
    /// grants it on PostgreSQL without waiting for its own log flush. The default is
    /// `acquire`.
    ///
    /// # Errors
    /// As [`acquire`](Self::acquire).
    async fn acquire_checked(&self, name: &LockName, wait: Duration, ttl: Duration) -> Acquired {
        self.acquire(name, wait, ttl).await
    }
}

/// A lock taken inside the write's transaction, ended by its commit or rollback.
#[async_trait]
pub trait TransactionLock: Send + Sync {
    /// Takes the lock `name` inside `txn`, waiting at most `wait`; it ends with the transaction.
    /// Returns whether the lock was taken.
    ///
    /// # Errors
    /// [`LockError`] when the backend fails.
    async fn lock_in_transaction(
        &self,
        txn: &DatabaseTransaction,
        name: &LockName,
        wait: Duration,
    ) -> Result<bool, LockError>;
}

/// What [`Fencing::verify_and_release_in`] found of a lease, in the write's transaction.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseCheck {
    /// The lease is no longer this guard's (it ran out and was taken over, or its fence moved
    /// on): the transaction must not commit.
    Lost,
    /// Still held; release it as usual once the transaction ended.
    Held,
    /// Still held, and the transaction releases it when it commits: then end the guard with
    /// [`LockGuard::released_by_commit`] (after a rollback it is still held: release it).
    HeldReleasedByCommit,
}

impl LeaseCheck {
    /// Whether the lease was still held.
    pub fn held(self) -> bool {
        self != Self::Lost
    }
}

/// A held lease lock: a core — its release — and what else it can do, exposed the way
/// [`LockBackend::role`] exposes how a backend locks: [`fencing`](Self::fencing) for grants that
/// carry a fence token, [`renewal`](Self::renewal) for leases that run out. A guard that has
/// neither (the in-process lock) implements only [`release`](Self::release). Callers use the
/// methods on `dyn LockGuard` (`fence`, `verify`, `verify_and_release_in`, `extend`), which ask
/// the capabilities.
///
/// Release it with [`release`](Self::release) after the transaction it protects has ended. What
/// dropping it without `release` does depends on the backend: the in-process lock is freed at once;
/// a lease on a server runs out by its TTL.
#[async_trait]
pub trait LockGuard: Send + Sync + fmt::Debug {
    /// The grant's fencing, for backends whose grants carry a fence token (`table`,
    /// `mysql_named`, `redis`); `None` (the default) for a lock that cannot be lost while held.
    fn fencing(&self) -> Option<&dyn Fencing> {
        None
    }

    /// The lease's renewal, for leases that run out by a TTL (`table`, `redis`); `None` (the
    /// default) for a lock without one.
    fn renewal(&self) -> Option<&dyn Renewal> {
        None
    }

    /// Ends a guard whose lease a committed transaction released (see
    /// [`Fencing::verify_and_release_in`]): nothing is sent. Only called after that method said
    /// it released; the default drops the guard.
    fn released_by_commit(self: Box<Self>) {}

    /// Releases the lock.
    ///
    /// # Errors
    /// [`LockError`] when the backend could not be told; the lease then runs out by its TTL.
    async fn release(self: Box<Self>) -> Result<(), LockError>;

    /// Releases the lock of a key that turned out not to exist (`locked_update` found no row,
    /// so this grant protected no write). Backends that keep a row per name in
    /// `freshlock_lock` delete it when it has no fence above the floor but this grant's (see
    /// [`crate::schema`]), so keys that never existed leave no rows; the unused fence may then
    /// be issued again. The default releases.
    ///
    /// # Errors
    /// As [`release`](Self::release).
    async fn retire(self: Box<Self>) -> Result<(), LockError> {
        self.release().await
    }
}

/// A grant's fence token, checked in the transaction of the write it guards.
#[async_trait]
pub trait Fencing: Send + Sync {
    /// The fence token of this grant: it grows with every grant of the same name. A backend
    /// may issue it in the transactions it checks instead of at the grant (`mysql_named`, whose
    /// grants then write nothing): there it is 0 until [`verify`](Self::verify) first returned
    /// `true`, and then the fence of the last transaction checked, growing with every checked
    /// transaction of the name. [`crate::LockReport::fence`] is the one the write's transaction
    /// had.
    fn fence(&self) -> u64;

    /// Checks, inside the transaction that is about to write, that this grant is still the
    /// current one. `locked_update` calls it before its UPDATE, through
    /// [`verify_and_release_in`](Self::verify_and_release_in) (unless its reload checked the
    /// fence, see [`fence_row`](Self::fence_row) and [`owned_row`](Self::owned_row)) and, when it
    /// returns `false`, rolls back and reports [`crate::UpdateOutcome::LeaseLost`].
    ///
    /// # Errors
    /// [`LockError`] when the check could not be made.
    async fn verify(&self, txn: &DatabaseTransaction) -> Result<bool, LockError>;

    /// The name this grant's fence is stored under in `freshlock_lock`, when
    /// [`verify`](Self::verify) is exactly the check that this row still holds
    /// [`fence`](Self::fence) (as for `redis`). `locked_update` then checks the
    /// fence in the statement that reloads the row (one round trip less per write) and calls
    /// `verify` only when that statement finds nothing. The fence row is then locked from the
    /// reload to the commit, not only from the check before the UPDATE: a newer grant of the
    /// name, possible only once this lease is lost, waits for the write to end before its fence
    /// is issued (and then reloads what it wrote). The default, `None`, always calls `verify`.
    fn fence_row(&self) -> Option<&str> {
        None
    }

    /// The row of `freshlock_lock` this grant holds, as `(name, owner)`, when
    /// [`verify_and_release_in`](Self::verify_and_release_in) is exactly one statement that frees
    /// that row (`owner` to NULL, `expires_at` to 0) where it still has this owner token, this
    /// [`fence`](Self::fence) and an `expires_at` (ms since the epoch, the database's clock) in
    /// the future (as for `table`). On PostgreSQL `locked_update` then checks and frees the lease
    /// in the statement that reloads the row (a data-modifying `WITH`: one round trip less per
    /// write): the lease row is locked from the reload to the commit, which ends the lease; after
    /// a rollback the lease is still held and is released as usual. When that statement finds
    /// nothing (the lease lost, or no row), the attempt runs again with the check by a statement
    /// of its own. On MySQL/MariaDB (no data-modifying `WITH`) the same statement is sent first
    /// in the message of the commit marker's INSERT and the UPDATE (or DELETE), its values
    /// written into the text; the write stands only where the message's count of rows confirms
    /// both the lease and the row, and otherwise runs again the same way. Ignored when
    /// [`fence_row`](Self::fence_row) is given. The default, `None`, checks with a statement of
    /// its own.
    fn owned_row(&self) -> Option<(&str, &str)> {
        None
    }

    /// [`verify`](Self::verify), and also release the lease inside `txn`, so that it ends
    /// exactly when `txn` commits: one statement and one commit fewer than verifying, committing
    /// and then releasing. On [`LeaseCheck::HeldReleasedByCommit`], once `txn` commits, end the
    /// guard with [`LockGuard::released_by_commit`] (nothing is sent); if `txn` rolls back, the
    /// lease is still held and must be released as usual. The default only verifies
    /// ([`LeaseCheck::Held`] or [`LeaseCheck::Lost`]).
    ///
    /// # Errors
    /// As [`verify`](Self::verify).
    async fn verify_and_release_in(
        &self,
        txn: &DatabaseTransaction,
    ) -> Result<LeaseCheck, LockError> {
        Ok(if self.verify(txn).await? {
            LeaseCheck::Held
        } else {
            LeaseCheck::Lost
        })
    }
}

/// A lease that runs out by a TTL, and can be extended by its holder.
#[async_trait]
pub trait Renewal: Send + Sync {
    /// Extends the lease to `ttl` from now, only while it is still this holder's. Returns
    /// whether it was extended (`false`: the lease had expired or was taken over).
    ///
    /// # Errors
    /// [`LockError`] when the backend could not be asked.
    async fn extend(&self, ttl: Duration) -> Result<bool, LockError>;
}

impl dyn LockGuard + '_ {
    /// The fence token of this grant ([`Fencing::fence`]), for backends that issue one.
    pub fn fence(&self) -> Option<u64> {
        self.fencing().map(Fencing::fence)
    }

    /// [`Fencing::verify`]; `Ok(true)`, sending nothing, for a lock without fencing.
    ///
    /// # Errors
    /// As [`Fencing::verify`].
    pub async fn verify(&self, txn: &DatabaseTransaction) -> Result<bool, LockError> {
        match self.fencing() {
            Some(fencing) => fencing.verify(txn).await,
            None => Ok(true),
        }
    }

    /// [`Fencing::verify_and_release_in`]; [`LeaseCheck::Held`] for a lock without fencing.
    ///
    /// # Errors
    /// As [`Fencing::verify`].
    pub async fn verify_and_release_in(
        &self,
        txn: &DatabaseTransaction,
    ) -> Result<LeaseCheck, LockError> {
        match self.fencing() {
            Some(fencing) => fencing.verify_and_release_in(txn).await,
            None => Ok(LeaseCheck::Held),
        }
    }

    /// [`Renewal::extend`]; `Ok(true)` for a lock without a lease to run out.
    ///
    /// # Errors
    /// As [`Renewal::extend`].
    pub async fn extend(&self, ttl: Duration) -> Result<bool, LockError> {
        match self.renewal() {
            Some(renewal) => renewal.extend(ttl).await,
            None => Ok(true),
        }
    }
}
