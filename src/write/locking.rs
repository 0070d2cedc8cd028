//! Taking and releasing the lock of one locked section, as the session's policy says: shared by
//! `locked_update` and `Session::with_lock`.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use sea_orm::{
    DatabaseTransaction, DbBackend, DbErr, IsolationLevel, SqliteTransactionMode,
    TransactionOptions,
};
use tracing::warn;

use crate::{
    db::{
        deadline::{lock_within, within},
        pool::Pool,
    },
    error::{Error, LockError, Result, database},
    lock::{
        LeaseCheck, LockBackend, LockGuard, LockKind, LockName, LockPolicy, LockRole, OnLockFailure,
    },
    outcome::LockReport,
};

/// Whether a transaction-scoped lock is taken by the step's first statement instead of a
/// statement of its own after `BEGIN` (one round trip less).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fold {
    /// It is not (a lease, another backend, another database, or a try there failed).
    Never,
    /// It may be (`pg_advisory` or `row` on PostgreSQL, `row` on MySQL/MariaDB, a lease whose
    /// fence lives in `freshlock_lock` on either, a `table` lease row on PostgreSQL — on
    /// MySQL/MariaDB in a row write's UPDATE message instead, see [`Locking::riding_write`]),
    /// in a transaction begun to fold it.
    Allowed,
    /// This transaction's lock is to be tried by the step's first statement (by a row write's
    /// UPDATE message, for a lease that rides there).
    Pending,
}

/// The lock a step's first statement tries, as a one-time filter evaluated before any row is
/// read or locked (see [`Locking::folding`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Folded {
    /// `(SELECT pg_try_advisory_xact_lock(key))`.
    Advisory(i64),
    /// `EXISTS (SELECT 1 FROM freshlock_row_lock WHERE name = … FOR NO KEY UPDATE SKIP
    /// LOCKED)`: the lock row of that stored name, when it exists and is free.
    Row(String),
    /// `EXISTS (SELECT 1 FROM freshlock_lock WHERE name = … AND fence = … FOR UPDATE SKIP
    /// LOCKED)`: a held lease's fence check (see [`crate::lock::Fencing::fence_row`]), locking
    /// the fence row until the transaction ends as the check by a statement of its own does.
    Fence {
        /// The fence row's (stored) name.
        name: String,
        /// The grant's fence.
        fence: i64,
    },
    /// `WITH freed AS (UPDATE freshlock_lock SET owner = NULL … WHERE name = … AND owner = … AND
    /// fence = … AND expires_at > now RETURNING 1)` before the statement, and `EXISTS (SELECT 1
    /// FROM freed)` in its `WHERE` (PostgreSQL only): a held lease's check that also frees it,
    /// so the commit ends the lease (see [`crate::lock::Fencing::owned_row`]), its row locked
    /// until the transaction ends as the check by a statement of its own does.
    Lease {
        /// The lease row's (stored) name.
        name: String,
        /// The grant's owner token.
        owner: String,
        /// The grant's fence.
        fence: i64,
    },
}

/// The lock of one locked section while it runs.
pub(crate) struct Locking {
    backend: Arc<dyn LockBackend>,
    on_failure: OnLockFailure,
    wait: Duration,
    /// What is being done, for errors and logs (the row, or the section's lock name).
    target: LockName,
    /// The in-process queue's guard.
    queue: Option<Box<dyn LockGuard>>,
    /// The lease, for lease backends.
    pub(crate) guard: Option<Box<dyn LockGuard>>,
    /// Whether to take a transaction-scoped lock in each transaction.
    in_transaction: bool,
    /// Whether that lock may ride on the step's first statement (see [`Self::folding`]).
    fold: Fold,
    /// The bound on one reply of the database (see `deadline.rs`).
    pub(crate) reply: std::time::Duration,
    /// The current transaction also releases the lease (see [`Self::verify`]).
    release_rides: bool,
    /// The current transaction's first statement checked the lease's fence (see
    /// [`Folded::Fence`]): [`Self::verify`] sends nothing.
    fence_checked: bool,
    /// A committed transaction released the lease: nothing to send at the end.
    released_by_commit: bool,
    pub(crate) report: LockReport,
}

impl Locking {
    /// Takes `lock` for `target`: first the in-process queue (for backends that reach outside the
    /// process), then the backend's lease. Returns `None` when `cancelled` fired first (nothing
    /// is held then).
    pub(crate) async fn take(
        backend: &Arc<dyn LockBackend>,
        policy: &LockPolicy,
        lock: &LockName,
        target: LockName,
        cancelled: impl Future<Output = ()>,
        is_cancelled: impl Fn() -> bool,
    ) -> Result<Option<Self>> {
        let backend = Arc::clone(backend);
        let mut locking = Self {
            on_failure: policy.on_failure,
            wait: policy.wait_per_try.saturating_mul(policy.lock_tries),
            target,
            queue: None,
            guard: None,
            in_transaction: false,
            fold: Fold::Never,
            reply: policy.reply_deadline(),
            release_rides: false,
            fence_checked: false,
            released_by_commit: false,
            report: LockReport {
                backend: backend.kind(),
                name: lock.clone(),
                held: false,
                tries: 0,
                waited: Duration::ZERO,
                fence: None,
                release_error: None,
            },
            backend,
        };

        // Queue in-process first when the backend reaches outside the process: then at most one
        // task per key and process waits on (and polls, or holds a connection for) the shared
        // lock, so many waiters on one hot key cannot drain the connection pool. The queue is
        // the backend's own (`LockBackend::queue`): sessions given the backend share it.
        let backend = Arc::clone(&locking.backend);
        let queue = backend.queue().filter(|_| !backend.in_process());
        if let Some(queue) = queue
            && let LockRole::Lease(lease) = queue.role()
        {
            let kind = queue.kind();
            let acquisition = tokio::select! {
                () = cancelled => return Ok(None),
                acquisition = policy.acquire(kind.as_str(), lease, lock) => acquisition,
            };
            locking.report.waited = acquisition.waited;
            match acquisition.result {
                Ok(Some(held)) => locking.queue = Some(held),
                _ => {
                    locking.report.tries = acquisition.tries;
                    locking.unavailable(None)?;
                    return Ok(Some(locking));
                }
            }
        }

        match backend.role() {
            LockRole::Transaction(_) => {
                locking.in_transaction = true;
                if matches!(locking.report.backend, LockKind::PgAdvisory | LockKind::Row) {
                    locking.fold = Fold::Allowed;
                }
            }
            LockRole::Lease(lease) => {
                // Not raced against cancellation: dropping a backend's acquire mid-statement could
                // leave a lease taken that nobody releases (until its TTL). The queue above bounds
                // this wait to one task per key; if the caller has gone, release at once.
                let acquisition = policy.acquire(backend.kind().as_str(), lease, lock).await;
                if is_cancelled() {
                    if let Ok(Some(held)) = acquisition.result
                        && let Err(error) = held.release().await
                    {
                        warn!(%lock, %error, "release after cancellation failed; the lease runs out by its TTL");
                    }
                    return Ok(None);
                }
                locking.report.tries = acquisition.tries;
                locking.report.waited += acquisition.waited;
                match acquisition.result {
                    Ok(Some(held)) => {
                        locking.report.fence = issued(held.as_ref());
                        locking.report.held = true;
                        let fencing = held.fencing();
                        let checked_by_row = fencing
                            .is_some_and(|f| f.fence_row().is_some() || f.owned_row().is_some());
                        if checked_by_row {
                            locking.fold = Fold::Allowed;
                        }
                        locking.guard = Some(held);
                    }
                    Ok(None) => locking.unavailable(None)?,
                    Err(source) => locking.unavailable(Some(source))?,
                }
            }
        }
        Ok(Some(locking))
    }

    /// Whether this section excludes every other section of this process on the same lock (the
    /// in-process queue, or the `local` lock itself, is held): only then may it serve the
    /// process's other writers of the row (commit combining).
    pub(crate) fn excludes_process(&self) -> bool {
        self.queue.is_some() || (self.backend.in_process() && self.report.held)
    }

    /// The policy's answer to a lock that could not be had: `Ok` to proceed without it.
    fn unavailable(&self, failure: Option<LockError>) -> Result<()> {
        let report = &self.report;
        let proceed = self.on_failure == OnLockFailure::Proceed;
        crate::metrics::acquire_failure(report.backend.as_str(), failure.is_some(), proceed);
        if !proceed {
            // No release follows a refusal: the wait is recorded here.
            crate::metrics::lock_wait(report.backend.as_str(), false, report.waited);
        }
        let failure = match failure {
            // A misconfigured pool, not a busy lock: proceeding would run every call unlocked.
            Some(failure) if failure.is_pooler_clash() => {
                return Err(crate::error::pooler_clash(
                    "taking the lock for",
                    &self.target.to_string(),
                    Box::new(failure),
                ));
            }
            other => other,
        };
        match (self.on_failure, failure) {
            (OnLockFailure::Fail, None) => Err(Error::LockNotAcquired {
                target: self.target.to_string(),
                lock: report.name.to_string(),
                tries: report.tries,
                waited: report.waited,
            }),
            (OnLockFailure::Fail, Some(source)) => Err(Error::Lock {
                target: self.target.to_string(),
                source,
            }),
            (_, failure) => {
                warn!(
                    lock = %report.name,
                    tries = report.tries,
                    waited_ms = report.waited.as_millis() as u64,
                    error = failure.map(|e| e.to_string()),
                    "proceeding without the lock"
                );
                Ok(())
            }
        }
    }

    /// Begins the section's transaction under `lockings` (in their order, which callers make
    /// canonical), every transaction-scoped lock taken in it. A timed-out lock wait aborts a
    /// PostgreSQL transaction: when one cannot be had and the policy says to go on, the
    /// transaction is ended and begun again without it (and the ones before it taken again).
    /// `detached`: the `BEGIN` runs in a task of its own (see [`begin_detached`]), for callers
    /// that may be dropped while it runs. `fold`: the caller's first statement tries the lock of
    /// a single `pg_advisory` or `row` locking itself, or checks its lease's fence (see
    /// [`Self::folding`]), so none is sent here (nor by [`Self::verify`]).
    pub(crate) async fn begin_all(
        lockings: &mut [Locking],
        db: &Pool,
        detached: bool,
        fold: bool,
    ) -> Result<DatabaseTransaction> {
        // Not on SQLite: its `row` lock sends nothing, and its statements are no round trips.
        let backend = db.get_database_backend();
        let folds = fold && lockings.len() == 1 && backend != DbBackend::Sqlite;
        // A lease released (or a fence checked) in an earlier attempt's transaction was not
        // released (checked) by this one's.
        for locking in lockings.iter_mut() {
            locking.release_rides = false;
            locking.fence_checked = false;
            if locking.fold == Fold::Pending {
                locking.fold = Fold::Allowed;
            }
        }
        let mut skipped = vec![false; lockings.len()];
        'again: loop {
            let reply = lockings
                .first()
                .map_or(crate::db::deadline::DEFAULT_REPLY, |l| l.reply);
            // A `BEGIN` past the bound ends on its own (see `detach::begin`).
            let began = if detached {
                within(reply, begin_detached(db)).await
            } else {
                within(reply, begin(db)).await
            };
            let txn = began.map_err(|e| {
                let target = lockings.first().map(|l| l.target.to_string());
                database(
                    "beginning the transaction for",
                    &target.unwrap_or_default(),
                    e,
                )
            })?;
            for (locking, skipped) in lockings.iter_mut().zip(skipped.iter_mut()) {
                let lease = locking.guard.is_some();
                let foldable = folds && locking.fold == Fold::Allowed && (lease || !*skipped);
                if foldable && (backend == DbBackend::Postgres || !locking.frees_in_fold()) {
                    locking.fold = Fold::Pending;
                    continue;
                }
                if !locking.in_transaction || *skipped {
                    continue;
                }
                if let Err(failure) = locking.lock_in(&txn).await {
                    let silent = failure.as_ref().is_some_and(LockError::is_no_reply);
                    crate::commit::rollback_after(txn, reply, silent).await;
                    locking.unavailable(failure)?;
                    *skipped = true;
                    continue 'again;
                }
            }
            return Ok(txn);
        }
    }

    /// The lock the step's first statement is to try in its `WHERE` (a one-time filter,
    /// evaluated before any row is read or locked; see [`Folded`]), when
    /// [`begin_all`](Self::begin_all) left this lock to it: `pg_advisory`'s key, `row`'s lock
    /// row, or a held lease's fence row. A try that fails — the lock busy, (`row`) its lock row
    /// not made yet, or the fence moved on — runs the attempt again with the lock taken (the
    /// fence checked) by statements of its own.
    pub(crate) fn folding(&self) -> Option<Folded> {
        if self.fold != Fold::Pending {
            return None;
        }
        if let Some(guard) = &self.guard {
            let fencing = guard.fencing()?;
            let fence = fence_of(fencing);
            if let Some(name) = fencing.fence_row() {
                let name = name.to_owned();
                return Some(Folded::Fence { name, fence });
            }
            let (name, owner) = fencing.owned_row()?;
            let (name, owner) = (name.to_owned(), owner.to_owned());
            return Some(Folded::Lease { name, owner, fence });
        }
        let name = &self.report.name;
        Some(match self.report.backend {
            LockKind::Row => Folded::Row(crate::lock::RowLock::stored_name(name)),
            _ => Folded::Advisory(crate::lock::PgAdvisoryLock::key(name)),
        })
    }

    /// How the try of [`folding`](Self::folding) went (`waited`: the statement's time).
    /// Not held — the lock is busy, or the statement found no row and so cannot tell — means
    /// the attempt is to be run again, the lock then taken by a statement of its own.
    pub(crate) fn folded(&mut self, held: bool, waited: Duration) {
        if self.guard.is_some() {
            // A lease's fence: the lease itself was had before the transaction. A lease row
            // freed by the statement is freed by this transaction's commit.
            self.fence_checked = held;
            self.release_rides = held && self.frees_in_fold();
            self.fold = if held { Fold::Allowed } else { Fold::Never };
            return;
        }
        self.report.tries = 1;
        self.report.waited += waited;
        if held {
            self.report.held = true;
            self.fold = Fold::Allowed;
        } else {
            self.fold = Fold::Never;
        }
    }

    /// The values of the lease's check-and-free ([`crate::lock::sql::lease_values`]) for a row
    /// write under `lockings` on MySQL/MariaDB to send first in the message of its commit marker
    /// (`marked`: it has one) and its UPDATE or DELETE (see
    /// [`crate::write::row_sql::update_with_evidence`]), where no statement before it can free the lease
    /// (no data-modifying `WITH` there): a single held `table` lease this transaction has not
    /// checked, whose check-and-free has not failed to ride before. The write then reports how
    /// it went with [`rode`](Self::rode); a check that did not confirm the lease runs the
    /// attempt again with the lease checked by a statement of its own.
    pub(crate) fn riding_write(
        lockings: &mut [Locking],
        backend: DbBackend,
        marked: bool,
    ) -> Option<[sea_orm::Value; 3]> {
        let [locking] = lockings else {
            return None;
        };
        let rides = marked && backend == DbBackend::MySql && locking.fold == Fold::Allowed;
        if !rides || locking.fence_checked || !locking.frees_in_fold() {
            return None;
        }
        let fencing = locking.guard.as_ref()?.fencing()?;
        let (name, owner) = fencing.owned_row()?;
        let values = crate::lock::sql::lease_values(name, owner, fence_of(fencing));
        locking.fold = Fold::Pending;
        Some(values)
    }

    /// How the row write that a lease rode in went ([`riding_write`](Self::riding_write), the
    /// one thing that leaves a lock `Pending` past the reload): `held`, it found the lease and
    /// its transaction frees it. Nothing when no lease rode.
    pub(crate) fn rode(lockings: &mut [Locking], held: bool) {
        if let [locking] = lockings
            && locking.fold == Fold::Pending
        {
            locking.folded(held, Duration::ZERO);
        }
    }

    /// Whether this lease is checked by a statement that frees its row ([`Folded::Lease`] on
    /// PostgreSQL, [`Self::riding_write`] on MySQL/MariaDB), not by reading its fence row
    /// ([`Folded::Fence`]).
    fn frees_in_fold(&self) -> bool {
        let fencing = self.guard.as_ref().and_then(|guard| guard.fencing());
        fencing.is_some_and(|f| f.fence_row().is_none() && f.owned_row().is_some())
    }

    /// Takes this transaction-scoped lock in `txn`: `Err` with the backend's error, if any, when
    /// it could not be had.
    async fn lock_in(
        &mut self,
        txn: &DatabaseTransaction,
    ) -> std::result::Result<(), Option<LockError>> {
        let started = tokio::time::Instant::now();
        let locked = match self.backend.role() {
            LockRole::Transaction(lock) => {
                // Its statements wait for the lock up to `wait` (MySQL/MariaDB count it in whole
                // seconds, rounded up); a reply later than that by a reply's bound is not coming
                // (`deadline.rs`): the backend failed, and the transaction is rolled back.
                let bound = (self.wait + Duration::from_secs(1)).saturating_add(self.reply);
                let locking = lock.lock_in_transaction(txn, &self.report.name, self.wait);
                lock_within(self.report.backend.as_str(), bound, locking).await
            }
            LockRole::Lease(_) => Ok(false),
        };
        self.report.tries = 1;
        self.report.waited += started.elapsed();
        match locked {
            Ok(true) => {
                self.report.held = true;
                Ok(())
            }
            Ok(false) => Err(None),
            Err(source) => Err(Some(source)),
        }
    }

    /// The fence check in the write's transaction: whether the lease (if any) is still this
    /// section's. A backend that can also releases the lease in `txn`, so the commit ends it
    /// (call [`committed`](Self::committed) once `txn` committed; after a rollback the lease is
    /// still held, and [`release`](Self::release) frees it).
    pub(crate) async fn verify(
        &mut self,
        txn: &DatabaseTransaction,
    ) -> std::result::Result<bool, LockError> {
        if self.fence_checked {
            // Checked (and its row locked until the end, or freed by the commit: see
            // `folded`) by the transaction's first statement.
            return Ok(true);
        }
        self.release_rides = false;
        let Some(guard) = &self.guard else {
            return Ok(true);
        };
        // A fence check whose reply does not come fails like a lost connection (`deadline.rs`).
        let backend = self.report.backend.as_str();
        let check = lock_within(backend, self.reply, guard.verify_and_release_in(txn)).await?;
        self.release_rides = check == LeaseCheck::HeldReleasedByCommit;
        if check.held() {
            // A backend that issues its fence in the check (`mysql_named`) has it now.
            self.report.fence = issued(guard.as_ref());
        }
        Ok(check.held())
    }

    /// The section's transaction committed (a write, or a commit that wrote nothing after a first
    /// statement that freed the lease): a lease it released is over.
    pub(crate) fn committed(&mut self) {
        self.released_by_commit |= self.release_rides;
    }

    /// Releases the lock — only call this after the transaction ended: releasing earlier would
    /// let the next holder reload data this transaction had not committed yet. A failed release
    /// does not undo a commit: it is reported, and the lease runs out by its TTL.
    pub(crate) async fn release(self) -> LockReport {
        self.end(false).await
    }

    /// [`release`](Self::release) for a key that turned out not to exist: the lease's row is
    /// dropped where it has no history (see [`crate::lock::LockGuard::retire`]).
    pub(crate) async fn retire(self) -> LockReport {
        self.end(true).await
    }

    async fn end(mut self, retire: bool) -> LockReport {
        crate::metrics::lock_wait(
            self.report.backend.as_str(),
            self.report.held,
            self.report.waited,
        );
        let released = match self.guard.take() {
            Some(guard) if self.released_by_commit => {
                guard.released_by_commit();
                None
            }
            Some(guard) if retire => Some(guard.retire().await),
            Some(guard) => Some(guard.release().await),
            None => None,
        };
        if let Some(Err(error)) = released {
            warn!(lock = %self.report.name, %error, "lock release failed; the lease runs out by its TTL");
            self.report.release_error = Some(crate::error::ReleaseError::new(error));
        }
        drop(self.queue.take());
        self.report
    }
}

impl fmt::Debug for Locking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locking")
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

/// A fence as the lock tables store it (BIGINT).
fn fence_of(fencing: &dyn crate::lock::Fencing) -> i64 {
    i64::try_from(fencing.fence()).unwrap_or(i64::MAX)
}

/// The fence `guard` has issued, if any (0: none yet; see [`crate::lock::Fencing::fence`]).
fn issued(guard: &dyn LockGuard) -> Option<u64> {
    guard.fence().filter(|&fence| fence > 0)
}

/// [`begin`] in a task of its own, awaited: a caller dropped while `BEGIN` is in flight must not
/// cut it in half, because sqlx counts the transaction only once `BEGIN`'s reply is read — a
/// connection whose `BEGIN` reply was never read goes back to the pool inside a transaction
/// nobody ends (the next `SET TRANSACTION` on it fails with MySQL 1568). The task finishes the
/// `BEGIN`, and if nobody takes the transaction, dropping it rolls it back.
pub(crate) async fn begin_detached(db: &Pool) -> std::result::Result<DatabaseTransaction, DbErr> {
    let db = db.clone();
    match tokio::spawn(async move { begin(&db).await }).await {
        Ok(began) => began,
        Err(e) => Err(DbErr::Custom(format!("beginning a transaction: {e}"))),
    }
}

/// `BEGIN IMMEDIATE` on SQLite (a DEFERRED transaction that reads, then writes fails with
/// "database is locked" without waiting), `READ COMMITTED` elsewhere (under REPEATABLE READ the
/// snapshot could predate the lock and the reload be stale) — set by `SET TRANSACTION` unless it
/// is the pool's default already (PostgreSQL's; see [`Pool::read_committed_by_default`]).
pub(crate) async fn begin(db: &Pool) -> std::result::Result<DatabaseTransaction, DbErr> {
    let options = match db.get_database_backend() {
        DbBackend::Sqlite => TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..TransactionOptions::default()
        },
        // Already the pool's default: a plain `BEGIN` (one round trip instead of two).
        _ if db.read_committed_by_default().await => TransactionOptions::default(),
        _ => TransactionOptions {
            isolation_level: Some(IsolationLevel::ReadCommitted),
            ..TransactionOptions::default()
        },
    };
    crate::db::live::begin(db, options).await
}

/// The lock space that excludes this process's writers of one key from each other under
/// `backend`: the backend itself when it is the in-process lock, else its in-process queue
/// ([`LockBackend::queue`]); `None` for a backend with neither, whose writes are never
/// combined. Sessions given the same lock space (`LocalLock::shared()` by default, whichever
/// `Arc` it was wrapped in; a backend's queue, shared by the backend's clones) share it.
pub(crate) fn exclusion(backend: &dyn LockBackend) -> Option<u64> {
    (backend.lock_space()).or_else(|| backend.queue().and_then(|queue| queue.lock_space()))
}
