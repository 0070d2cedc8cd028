//! A short transactional section under a keyed lock, for work that is not one row's update.

use std::{future::Future, pin::Pin};

use sea_orm::DatabaseTransaction;
use tracing::{Instrument, info_span, warn};

use crate::{
    error::{ApplyError, Error, Result},
    lock::LockName,
    locking::Locking,
    outcome::LockReport,
    session::Session,
};

/// What [`Session::locked`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum SectionOutcome<T> {
    /// The section's work was committed; holds what it returned.
    Committed(T),
    /// The lease was lost before the commit (fencing refused): rolled back, nothing written.
    LeaseLost,
}

/// The result of [`Session::locked`]: the outcome and how the lock went.
#[derive(Debug)]
#[non_exhaustive]
pub struct SectionReport<T> {
    /// What happened.
    pub outcome: SectionOutcome<T>,
    /// How the lock went.
    pub lock: LockReport,
}

/// The work of a locked section: given the transaction, a future of its result.
pub type SectionWork<'t, T> = Pin<Box<dyn Future<Output = Result<T, ApplyError>> + Send + 't>>;

impl Session {
    /// Runs `work` in one short transaction under the lock `lock` (for example
    /// [`crate::lock_name::<ham::Entity>(ham_id)`](crate::lock_name)): take the lock under the
    /// session's policy → begin (`BEGIN IMMEDIATE` / `READ COMMITTED`; transaction-scoped
    /// backends lock in it) → `work(&txn)` → check the lease's fence → commit → release. For
    /// work that is not a single-row update; keep heavy work outside.
    ///
    /// `work` is not retried (it may have side effects): a transient error is returned as it is
    /// ([`Error::is_transient`] says whether to call again).
    ///
    /// # Errors
    /// [`Error::Apply`] when `work` fails (rolled back); [`Error::LockNotAcquired`] /
    /// [`Error::Lock`] when the policy fails without the lock; [`Error::Database`].
    ///
    /// # Cancel safety
    /// Not the detached kind of `locked_update` (`work` may borrow from the caller): dropping
    /// the future drops the transaction, which rolls back, and the lock, which is released (a
    /// server lease by its guard's background release, or its TTL).
    pub async fn locked<T, F>(&self, lock: &LockName, work: F) -> Result<SectionReport<T>>
    where
        T: Send,
        F: for<'t> FnOnce(&'t DatabaseTransaction) -> SectionWork<'t, T> + Send,
    {
        let span = info_span!("locked", lock = %lock, backend = self.lock_backend().kind());
        async move {
            let _in_flight = self.section_started();
            let taken = Locking::take(
                self.lock_backend(),
                self.policy(),
                lock,
                lock.clone(),
                std::future::pending(),
                || false,
            );
            let Some(mut locking) = taken.await? else {
                return Err(Error::Interrupted {
                    target: lock.to_string(),
                });
            };
            let result = Self::run_section(&mut locking, self, lock, work).await;
            let report = locking.release().await;
            result.map(|outcome| SectionReport {
                outcome,
                lock: report,
            })
        }
        .instrument(span)
        .await
    }

    async fn run_section<T, F>(
        locking: &mut Locking,
        session: &Session,
        lock: &LockName,
        work: F,
    ) -> Result<SectionOutcome<T>>
    where
        T: Send,
        F: for<'t> FnOnce(&'t DatabaseTransaction) -> SectionWork<'t, T> + Send,
    {
        let txn = locking.begin(session.connection()).await?;
        let value = match work(&txn).await {
            Ok(value) => value,
            Err(source) => {
                let _ = txn.rollback().await;
                return Err(Error::Apply {
                    target: lock.to_string(),
                    source: source.into_inner(),
                });
            }
        };
        if let Some(guard) = &locking.guard {
            match guard.verify(&txn).await {
                Ok(true) => {}
                Ok(false) => {
                    let _ = txn.rollback().await;
                    warn!(%lock, "lease lost before the commit; rolled back");
                    crate::metrics::lease_lost(locking.report.backend);
                    return Ok(SectionOutcome::LeaseLost);
                }
                Err(source) => {
                    let _ = txn.rollback().await;
                    return Err(Error::Lock {
                        target: lock.to_string(),
                        source,
                    });
                }
            }
        }
        crate::commit::commit_write(
            txn,
            session.commit_markers(),
            session.connection(),
            lock.as_str(),
        )
        .await?;
        Ok(SectionOutcome::Committed(value))
    }
}
