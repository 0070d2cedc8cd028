//! The locked read-modify-write behind [`crate::Repository::locked_update`].
//!
//! The section — lock, transaction, reload, write, commit, cache, release — is a future of its own
//! (the *driver*), and `apply` runs in the caller, between its two halves. They talk over two
//! channels: the driver sends the reloaded row, the caller answers with the changed columns. The
//! caller polls the driver in place; if the caller is cancelled at any await, the driver moves to
//! a task of its own ([`Detachable`]) instead of being cut in half: it notices the closed
//! channel, rolls back (or, past the point of no return, commits) and releases the lock after the
//! transaction ended. `apply` need not be `'static`, since it never leaves the caller.

use std::{
    any::TypeId,
    future::Future,
    panic::{AssertUnwindSafe, catch_unwind, resume_unwind},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use backon::{BackoffBuilder, ExponentialBuilder};
use sea_orm::{
    ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, EntityTrait, IntoActiveModel,
    QuerySelect, Value,
};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, error, field, info_span, warn};

use crate::{
    error::{ApplyError, Error, Result, database},
    locking::Locking,
    outcome::{UpdateOutcome, UpdateReport},
    repository::{Guard, changed_columns, next_version, with_changes, write_changes},
    row::{Row, is_primary_key, select_by_key},
    session::Session,
};

/// The caller's answer to a reloaded row: the row back, and the columns `apply` changed.
struct Write<E: EntityTrait> {
    original: E::Model,
    changes: Vec<(E::Column, Value)>,
}

pub(crate) async fn run<E, F>(
    session: &Session,
    row: Row,
    mut apply: F,
) -> Result<UpdateReport<E::Model>>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
    F: FnMut(&mut E::ActiveModel) -> Result<(), ApplyError> + Send,
{
    let (reloaded_tx, mut reloaded) = mpsc::channel::<E::Model>(1);
    let (writes, writes_rx) = mpsc::channel::<Write<E>>(1);
    // Fields are evaluated only when a subscriber wants the span; the empty ones are filled in
    // when the section ends.
    let span = info_span!(
        "locked_update",
        entity = E::default().table_name(),
        key = row.name.as_str().split_once(':').map_or("", |(_, key)| key),
        lock = %row.lock,
        backend = session.lock_backend().kind(),
        lock_wait_ms = field::Empty,
        lock_held = field::Empty,
        attempts = field::Empty,
        conflicts = field::Empty,
        outcome = field::Empty,
    );
    let driver = Driver::<E> {
        session: session.clone(),
        row: row.clone(),
        reloaded: reloaded_tx,
        writes: writes_rx,
    };
    let mut driver = Detachable::new(driver.run().instrument(span));

    loop {
        // Both halves are polled by this one task (no thread hop per message). The driver only
        // moves to a task of its own if this future is dropped (see `Detachable`).
        let original = tokio::select! {
            biased;
            received = reloaded.recv() => match received {
                Some(original) => original,
                None => break,
            },
            result = &mut driver => return result,
        };
        let mut draft = original.clone().into_active_model();
        let abort = match catch_unwind(AssertUnwindSafe(|| apply(&mut draft))) {
            Ok(Ok(())) => {
                let changes = changed_columns::<E>(&original, &mut draft);
                if changes
                    .iter()
                    .any(|(column, _)| is_primary_key::<E>(column))
                {
                    Err(Error::PrimaryKeyChanged {
                        target: row.to_string(),
                    })
                } else {
                    if writes.send(Write { original, changes }).await.is_err() {
                        break; // The driver is gone; its result says why.
                    }
                    continue;
                }
            }
            Ok(Err(source)) => Err(Error::Apply {
                target: row.to_string(),
                source: source.into_inner(),
            }),
            Err(panic) => Ok(panic),
        };
        // Abort: closing the channel makes the driver roll back and release; finish it so the
        // lock is free when the caller sees the error (or the panic).
        drop(writes);
        let _ = (&mut driver).await;
        match abort {
            Err(error) => return Err(error),
            Ok(panic) => resume_unwind(panic),
        }
    }
    driver.await
}

/// The driver's future, polled in place by the caller; if the caller is dropped before it
/// finished, `Drop` moves it (it is boxed, so it does not move in memory) to a task of its own,
/// which runs it to its commit or rollback and lock release. A statement is thus never cut in
/// half by a cancellation, without paying for a task and thread hops on every call.
struct Detachable<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
}

impl<T: Send + 'static> Detachable<T> {
    fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }
}

impl<T: Send + 'static> Future for Detachable<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending; // Finished already: never polled again by our callers.
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for Detachable<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        // While unwinding from a panic inside the driver the future cannot be polled again;
        // dropping it rolls the transaction back (queued on the connection) and frees the lock.
        if std::thread::panicking() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    let _ = future.await;
                });
            }
            Err(_) => error!("locked section dropped outside a tokio runtime; rolled back on drop"),
        }
    }
}

/// How one run of the locked section ended.
enum Step<M> {
    /// With an outcome to report.
    Done(UpdateOutcome<M>),
    /// The optimistic guard refused the write: run it again.
    Conflict,
}

/// The task that owns the lock and the transaction of one `locked_update`.
struct Driver<E: EntityTrait> {
    session: Session,
    row: Row,
    reloaded: mpsc::Sender<E::Model>,
    writes: mpsc::Receiver<Write<E>>,
}

impl<E> Driver<E>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
    /// Runs the section and records how it ended (span fields, metrics).
    async fn run(self) -> Result<UpdateReport<E::Model>> {
        let entity = E::default().table_name();
        let result = self.run_locked().await;
        let outcome = match &result {
            Ok(report) => {
                let span = tracing::Span::current();
                span.record("lock_wait_ms", report.lock.waited.as_secs_f64() * 1e3);
                span.record("lock_held", report.lock.held);
                span.record("attempts", report.attempts);
                span.record("conflicts", report.conflicts);
                match report.outcome {
                    UpdateOutcome::Updated(_) => "updated",
                    UpdateOutcome::Unchanged(_) => "unchanged",
                    UpdateOutcome::NotFound => "not_found",
                    UpdateOutcome::LeaseLost => "lease_lost",
                }
            }
            Err(Error::Interrupted { .. }) => "interrupted",
            Err(Error::Conflict { .. }) => "conflict",
            Err(Error::LockNotAcquired { .. }) => "lock_not_acquired",
            Err(_) => "error",
        };
        tracing::Span::current().record("outcome", outcome);
        crate::metrics::update(entity, outcome);
        result
    }

    async fn run_locked(mut self) -> Result<UpdateReport<E::Model>> {
        let _in_flight = self.session.section_started();
        let policy = self.session.policy().clone();
        let taken = Locking::take(
            &self.session,
            &self.row.lock,
            self.row.name.clone(),
            self.reloaded.closed(),
            || self.reloaded.is_closed(),
        )
        .await?;
        let Some(mut locking) = taken else {
            return Err(self.interrupted()); // The caller gave up while we waited.
        };
        let (mut attempts, mut conflicts) = (0, 0);
        let mut delays = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(2))
            .with_max_delay(Duration::from_millis(200))
            .with_jitter()
            .with_max_times(policy.attempts.saturating_sub(1) as usize)
            .build();
        let result = loop {
            attempts += 1;
            let step = self.section(&mut locking).await;
            let retry = match &step {
                Ok(Step::Done(_)) => false,
                Ok(Step::Conflict) => {
                    conflicts += 1;
                    crate::metrics::conflict(E::default().table_name());
                    warn!(row = %self.row.name, attempts, "conflict: the row changed since it was read");
                    true
                }
                Err(error) if error.is_transient() => {
                    warn!(row = %self.row.name, attempts, %error, "transient database error");
                    true
                }
                Err(_) => false,
            };
            match (step, retry.then(|| delays.next()).flatten()) {
                (Ok(Step::Done(outcome)), _) => break Ok(outcome),
                (Ok(Step::Conflict), None) => {
                    break Err(Error::Conflict {
                        target: self.row.to_string(),
                        attempts,
                    });
                }
                (Err(error), None) => break Err(error),
                (_, Some(delay)) => {
                    debug!(row = %self.row.name, ?delay, "running the locked section again");
                    tokio::time::sleep(delay).await;
                }
            }
        };

        // Only now, after commit or rollback.
        let report = locking.release().await;
        result.map(|outcome| UpdateReport {
            outcome,
            lock: report,
            attempts,
            conflicts,
        })
    }

    /// Evict, begin, reload, hand over to `apply`, write, commit, cache.
    async fn section(&mut self, locking: &mut Locking) -> Result<Step<E::Model>> {
        let db = self.session.connection();
        self.session.map().remove(&self.row.key);
        let txn = locking.begin(db).await?;

        let mut reload = select_by_key::<E>(self.row.pk());
        if txn.get_database_backend() != DbBackend::Sqlite {
            reload = reload.lock_exclusive();
        }
        let original = match reload.one(&txn).await {
            Ok(Some(original)) => original,
            Ok(None) => {
                finish(txn, false, &self.row).await?;
                return Ok(Step::Done(UpdateOutcome::NotFound));
            }
            Err(e) => return Err(self.rolled_back(txn, "reloading", e).await),
        };

        if self.reloaded.send(original).await.is_err() {
            return Err(self.abandoned(txn).await);
        }
        let Some(Write { original, changes }) = self.writes.recv().await else {
            return Err(self.abandoned(txn).await);
        };

        if changes.is_empty() {
            finish(txn, true, &self.row).await?;
            let original = Arc::new(original);
            self.session
                .map()
                .insert(self.row.key.clone(), Arc::clone(&original));
            debug!(row = %self.row.name, "unchanged");
            return Ok(Step::Done(UpdateOutcome::Unchanged(original)));
        }
        if let Some(guard) = &locking.guard {
            match guard.verify(&txn).await {
                Ok(true) => {}
                Ok(false) => {
                    finish(txn, false, &self.row).await?;
                    warn!(row = %self.row.name, fence = locking.report.fence, "lease lost before the write; nothing written");
                    crate::metrics::lease_lost(locking.report.backend);
                    return Ok(Step::Done(UpdateOutcome::LeaseLost));
                }
                Err(source) => {
                    let _ = txn.rollback().await;
                    return Err(Error::Lock {
                        target: self.row.to_string(),
                        source,
                    });
                }
            }
        }
        // The optimistic guard: the UPDATE also checks that the row still holds what was read
        // (its version column when one is declared, else the changed columns), so a write made
        // without the lock can never overwrite a change it did not see.
        let mut changes = changes;
        let guard = match self.session.version_column(TypeId::of::<E>()) {
            Some(name) => match next_version::<E>(&original, name) {
                Some(next) => {
                    changes.push(next);
                    Guard::Version(name)
                }
                None => {
                    let _ = txn.rollback().await;
                    return Err(Error::VersionColumn {
                        entity: E::default().table_name(),
                        column: name,
                    });
                }
            },
            None => Guard::Columns,
        };
        match write_changes::<E, _>(&txn, &original, &changes, guard).await {
            Ok(true) => {}
            Ok(false) => {
                finish(txn, false, &self.row).await?;
                return Ok(Step::Conflict);
            }
            Err(e) => return Err(self.rolled_back(txn, "writing", e).await),
        }
        let committed =
            with_changes::<E>(&original, changes).map_err(|e| database("applying", &self.row, e));
        finish(txn, true, &self.row).await?;
        let committed = Arc::new(committed?);
        self.session
            .map()
            .insert(self.row.key.clone(), Arc::clone(&committed));
        debug!(row = %self.row.name, "updated");
        Ok(Step::Done(UpdateOutcome::Updated(committed)))
    }

    /// The caller is gone or aborted: roll back, and report (to nobody, or to a caller that
    /// returns its own error instead).
    async fn abandoned(&self, txn: DatabaseTransaction) -> Error {
        if let Err(error) = txn.rollback().await {
            warn!(row = %self.row.name, %error, "rollback failed");
        }
        self.interrupted()
    }

    async fn rolled_back(
        &self,
        txn: DatabaseTransaction,
        operation: &'static str,
        e: DbErr,
    ) -> Error {
        if let Err(error) = txn.rollback().await {
            warn!(row = %self.row.name, %error, "rollback failed");
        }
        database(operation, &self.row, e)
    }

    fn interrupted(&self) -> Error {
        Error::Interrupted {
            target: self.row.to_string(),
        }
    }
}

async fn finish(txn: DatabaseTransaction, commit: bool, row: &Row) -> Result<()> {
    let ended = if commit {
        txn.commit().await
    } else {
        txn.rollback().await
    };
    ended.map_err(|e| database("committing", row, e))
}
