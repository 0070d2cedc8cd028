//! Taking and releasing the lock of one locked section, as the session's policy says: shared by
//! `locked_update` and `Session::with_lock`.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use sea_orm::{DatabaseTransaction, DbBackend};
use tracing::warn;

use crate::db::begin::{begin, begin_detached};
use crate::{
    db::{deadline::within, pool::Pool},
    error::{Error, LockError, Result, database},
    lock::bound::lock_within,
    lock::{
        LeaseCheck, LockBackend, LockGuard, LockKind, LockName, LockPolicy, LockRole, OnLockFailure,
    },
    outcome::LockReport,
};

/// Whether a transaction-scoped lock is taken by the step's first statement instead of a
/// statement of its own after `BEGIN` (one round trip less).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fold {
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

/// The lock of one locked section while it runs.
pub(crate) struct Locking {
    pub(super) backend: Arc<dyn LockBackend>,
    pub(super) on_failure: OnLockFailure,
    pub(super) wait: Duration,
    /// What is being done, for errors and logs (the row, or the section's lock name).
    pub(super) target: LockName,
    /// The in-process queue's guard.
    pub(super) queue: Option<Box<dyn LockGuard>>,
    /// The lease, for lease backends.
    pub(crate) guard: Option<Box<dyn LockGuard>>,
    /// Whether to take a transaction-scoped lock in each transaction.
    pub(super) in_transaction: bool,
    /// Whether that lock may ride on the step's first statement (see [`Self::folding`]).
    pub(super) fold: Fold,
    /// The bound on one reply of the database (see `deadline.rs`).
    pub(crate) reply: std::time::Duration,
    /// The current transaction also releases the lease (see [`Self::verify`]).
    pub(super) release_rides: bool,
    /// The current transaction's first statement checked the lease's fence (see
    /// [`Folded::Fence`]): [`Self::verify`] sends nothing.
    pub(super) fence_checked: bool,
    /// A committed transaction released the lease: nothing to send at the end.
    pub(super) released_by_commit: bool,
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

    /// Whether this lock asks nothing of the write's transaction: no statement to take it there,
    /// no fence to check before the commit (the in-process `local` lock, or none had).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn asks_nothing_of_the_transaction(&self) -> bool {
        !self.in_transaction && (self.guard.as_ref()).is_none_or(|guard| guard.fencing().is_none())
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
                    crate::db::own::rollback_after(txn, reply, silent).await;
                    locking.unavailable(failure)?;
                    *skipped = true;
                    continue 'again;
                }
            }
            return Ok(txn);
        }
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

/// The fence `guard` has issued, if any (0: none yet; see [`crate::lock::Fencing::fence`]).
fn issued(guard: &dyn LockGuard) -> Option<u64> {
    guard.fence().filter(|&fence| fence > 0)
}

/// The lock space that excludes this process's writers of one key from each other under
/// `backend`: the backend itself when it is the in-process lock, else its in-process queue
/// ([`LockBackend::queue`]); `None` for a backend with neither, whose writes are never
/// combined. Sessions given the same lock space (`LocalLock::shared()` by default, whichever
/// `Arc` it was wrapped in; a backend's queue, shared by the backend's clones) share it.
pub(crate) fn exclusion(backend: &dyn LockBackend) -> Option<u64> {
    (backend.lock_space()).or_else(|| backend.queue().and_then(|queue| queue.lock_space()))
}
