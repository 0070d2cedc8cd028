//! The locked read-modify-write behind [`crate::Repository::locked_update`], and the locked
//! delete, get-or-insert and update-or-insert built on the same driver.
//!
//! The section — lock, transaction, reload, write, commit, cache, release — is a future of its own
//! (the *driver*), and `apply` runs in the caller, between its two halves. They talk over two
//! channels: the driver sends the reloaded row (or its absence), the caller answers with a
//! [`Decision`] (update these columns, insert, delete, or keep the row as it is). The
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
    ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, EntityTrait, IdenStatic,
    IntoActiveModel, ModelTrait, QuerySelect,
};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, error, field, info_span, warn};

use crate::{
    error::{Error, Result, database},
    locking::Locking,
    outcome::Report,
    row::{Row, select_by_key},
    session::Session,
    write,
};

/// What the caller decided, given the row as reloaded under the lock (`None`: no such row).
pub(crate) enum Decision<E: EntityTrait> {
    /// Write nothing: report the row as read ([`Written::Unchanged`]), or [`Written::NotFound`].
    Keep(Option<E::Model>),
    /// Write the columns `draft` changed relative to `original` (after `before_save`).
    Update {
        original: E::Model,
        draft: E::ActiveModel,
    },
    /// Insert `draft` (the row was missing).
    Insert(E::ActiveModel),
    /// Delete `original`.
    Delete(E::Model),
}

/// How a locked write ended (the front ends turn it into their public outcome).
#[derive(Debug)]
pub(crate) enum Written<M> {
    Updated(Arc<M>),
    Unchanged(Arc<M>),
    Inserted(Arc<M>),
    Deleted(Arc<M>),
    NotFound,
    LeaseLost,
}

impl<M> Written<M> {
    fn name(&self) -> &'static str {
        match self {
            Self::Updated(_) => "updated",
            Self::Unchanged(_) => "unchanged",
            Self::Inserted(_) => "inserted",
            Self::Deleted(_) => "deleted",
            Self::NotFound => "not_found",
            Self::LeaseLost => "lease_lost",
        }
    }
}

/// Runs one locked write of `row`: `decide` is called in the caller with the row as reloaded
/// under the lock, and says what to write. It is `FnMut` because a conflict or a transient error
/// runs the section again.
pub(crate) async fn run<E, D>(
    session: &Session,
    row: Row,
    mut decide: D,
) -> Result<Report<Written<E::Model>>>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
    D: FnMut(Option<E::Model>) -> Result<Decision<E>> + Send,
{
    let (reloaded_tx, mut reloaded) = mpsc::channel::<Option<E::Model>>(1);
    let (decisions, decisions_rx) = mpsc::channel::<Decision<E>>(1);
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
        row,
        reloaded: reloaded_tx,
        decisions: decisions_rx,
    };
    let mut driver = Detachable::new(driver.run().instrument(span));

    loop {
        // Both halves are polled by this one task (no thread hop per message). The driver only
        // moves to a task of its own if this future is dropped (see `Detachable`).
        let found = tokio::select! {
            biased;
            received = reloaded.recv() => match received {
                Some(found) => found,
                None => break,
            },
            result = &mut driver => return result,
        };
        let abort = match catch_unwind(AssertUnwindSafe(|| decide(found))) {
            Ok(Ok(decision)) => {
                if decisions.send(decision).await.is_err() {
                    break; // The driver is gone; its result says why.
                }
                continue;
            }
            Ok(Err(error)) => Err(error),
            Err(panic) => Ok(panic),
        };
        // Abort: closing the channel makes the driver roll back and release; finish it so the
        // lock is free when the caller sees the error (or the panic).
        drop(decisions);
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
    Done(Written<M>),
    /// The optimistic guard refused the write (or a concurrent creator won): run it again.
    Conflict,
}

/// The task that owns the lock and the transaction of one locked write.
struct Driver<E: EntityTrait> {
    session: Session,
    row: Row,
    reloaded: mpsc::Sender<Option<E::Model>>,
    decisions: mpsc::Receiver<Decision<E>>,
}

impl<E> Driver<E>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
    /// Runs the section and records how it ended (span fields, metrics).
    async fn run(self) -> Result<Report<Written<E::Model>>> {
        let entity = E::default().table_name();
        let result = self.run_locked().await;
        let outcome = match &result {
            Ok(report) => {
                let span = tracing::Span::current();
                span.record("lock_wait_ms", report.lock.waited.as_secs_f64() * 1e3);
                span.record("lock_held", report.lock.held);
                span.record("attempts", report.attempts);
                span.record("conflicts", report.conflicts);
                report.outcome.name()
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

    async fn run_locked(mut self) -> Result<Report<Written<E::Model>>> {
        let _in_flight = self.session.section_started();
        let policy = self.session.policy().clone();
        let taken = Locking::take(
            self.session.lock_backend(),
            &policy,
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

        // Only now, after commit or rollback. A key that does not exist leaves no lock row.
        let report = if matches!(result, Ok(Written::NotFound)) {
            locking.retire().await
        } else {
            locking.release().await
        };
        result.map(|outcome| Report {
            outcome,
            lock: report,
            attempts,
            conflicts,
        })
    }

    /// Evict, begin, reload, hand over to the caller, write what it decided, commit, cache.
    async fn section(&mut self, locking: &mut Locking) -> Result<Step<E::Model>> {
        let db = self.session.connection();
        self.session.map().remove(&self.row.key);
        let txn = locking.begin(db).await?;

        let found = match reload_for_update::<E>(&txn, self.row.pk()).await {
            Ok(found) => found,
            Err(e) => return Err(self.rolled_back(txn, "reloading", e).await),
        };
        if self.reloaded.send(found).await.is_err() {
            return Err(self.abandoned(txn).await);
        }
        let Some(decision) = self.decisions.recv().await else {
            return Err(self.abandoned(txn).await);
        };
        match decision {
            Decision::Keep(None) => {
                finish(txn, false, &self.row).await?;
                Ok(Step::Done(Written::NotFound))
            }
            Decision::Keep(Some(original)) => {
                finish(txn, true, &self.row).await?;
                debug!(row = %self.row.name, "unchanged");
                Ok(Step::Done(Written::Unchanged(self.cache(original))))
            }
            Decision::Update { original, draft } => {
                self.update(txn, locking, original, draft).await
            }
            Decision::Insert(draft) => self.insert(txn, draft).await,
            Decision::Delete(original) => self.delete(txn, locking, original).await,
        }
    }

    /// `before_save`, the guarded UPDATE (fence checked first), `after_save`, commit.
    async fn update(
        &self,
        txn: DatabaseTransaction,
        locking: &Locking,
        original: E::Model,
        draft: E::ActiveModel,
    ) -> Result<Step<E::Model>> {
        let mut draft = match write::before_save::<E, _>(draft, &txn, false).await {
            Ok(draft) => draft,
            Err(e) => return Err(self.rolled_back(txn, "running before_save for", e).await),
        };
        let mut changes = write::changed_columns::<E>(&original, &mut draft);
        if changes
            .iter()
            .any(|(column, _)| write::is_primary_key::<E>(column))
        {
            let _ = txn.rollback().await;
            return Err(Error::PrimaryKeyChanged {
                target: self.row.to_string(),
            });
        }
        if changes.is_empty() {
            finish(txn, true, &self.row).await?;
            return Ok(Step::Done(Written::Unchanged(self.cache(original))));
        }
        if let Some(step) = self.fence(&txn, locking).await? {
            let _ = txn.rollback().await;
            return Ok(step);
        }
        // The optimistic guard: the UPDATE also checks that the row still holds what was read
        // (its version column when one is declared, else the changed columns), so a write made
        // without the lock can never overwrite a change it did not see.
        let expected = match self.session.version_column(TypeId::of::<E>()) {
            Some(name) => {
                let Some(column) = write::column_named::<E>(name) else {
                    let _ = txn.rollback().await;
                    return Err(self.version_error(name));
                };
                let read = original.get(column);
                let Some(next) = write::next_version(&read) else {
                    let _ = txn.rollback().await;
                    return Err(self.version_error(name));
                };
                changes.retain(|(changed, _)| changed.as_str() != name);
                changes.push((column, next));
                vec![(column, read)]
            }
            None => changes
                .iter()
                .map(|(column, _)| (*column, original.get(*column)))
                .collect(),
        };
        let stored =
            match write::update_returning::<E, _>(&txn, &original, &changes, &expected).await {
                Ok(Some(stored)) => stored,
                Ok(None) => {
                    finish(txn, false, &self.row).await?;
                    return Ok(Step::Conflict);
                }
                Err(e) => return Err(self.rolled_back(txn, "writing", e).await),
            };
        let reported = match write::after_save::<E, _>(stored.clone(), &txn, false).await {
            Ok(reported) => reported,
            Err(e) => return Err(self.rolled_back(txn, "running after_save for", e).await),
        };
        self.commit(txn).await?;
        self.cache(stored);
        debug!(row = %self.row.name, "updated");
        Ok(Step::Done(Written::Updated(Arc::new(reported))))
    }

    /// `before_save`, INSERT … RETURNING, `after_save`, commit. No fence check: an insert cannot
    /// overwrite anything, and a concurrent creator makes it fail on the key (a conflict: the
    /// next attempt finds the winner's row).
    async fn insert(
        &self,
        txn: DatabaseTransaction,
        draft: E::ActiveModel,
    ) -> Result<Step<E::Model>> {
        let draft = match write::before_save::<E, _>(draft, &txn, true).await {
            Ok(draft) => draft,
            Err(e) => return Err(self.rolled_back(txn, "running before_save for", e).await),
        };
        let stored = match E::insert(draft).exec_with_returning(&txn).await {
            Ok(stored) => stored,
            Err(e) if write::is_unique_violation(&e) => {
                finish(txn, false, &self.row).await?;
                return Ok(Step::Conflict);
            }
            Err(e) => return Err(self.rolled_back(txn, "inserting", e).await),
        };
        let reported = match write::after_save::<E, _>(stored.clone(), &txn, true).await {
            Ok(reported) => reported,
            Err(e) => return Err(self.rolled_back(txn, "running after_save for", e).await),
        };
        self.commit(txn).await?;
        self.cache(stored);
        debug!(row = %self.row.name, "inserted");
        Ok(Step::Done(Written::Inserted(Arc::new(reported))))
    }

    /// Fence, `before_delete`, DELETE (guarded by the version column when one is declared),
    /// `after_delete`, commit, evict.
    async fn delete(
        &self,
        txn: DatabaseTransaction,
        locking: &Locking,
        original: E::Model,
    ) -> Result<Step<E::Model>> {
        if let Some(step) = self.fence(&txn, locking).await? {
            let _ = txn.rollback().await;
            return Ok(step);
        }
        let draft = original.clone().into_active_model();
        let draft = match write::before_delete::<E, _>(draft, &txn).await {
            Ok(draft) => draft,
            Err(e) => return Err(self.rolled_back(txn, "running before_delete for", e).await),
        };
        let version = self.session.version_column(TypeId::of::<E>());
        let expected = write::version_guard::<E>(version, &original);
        match write::delete_holding::<E, _>(&txn, self.row.pk(), &expected).await {
            Ok(true) => {}
            Ok(false) => {
                finish(txn, false, &self.row).await?;
                return Ok(Step::Conflict);
            }
            Err(e) => return Err(self.rolled_back(txn, "deleting", e).await),
        }
        if let Err(e) = write::after_delete::<E, _>(draft, &txn).await {
            return Err(self.rolled_back(txn, "running after_delete for", e).await);
        }
        self.commit(txn).await?;
        self.session.map().remove(&self.row.key);
        debug!(row = %self.row.name, "deleted");
        Ok(Step::Done(Written::Deleted(Arc::new(original))))
    }

    /// The lease's fence check in the write's transaction: `Some(LeaseLost)` when a newer holder
    /// has the lock (the caller rolls back).
    async fn fence(
        &self,
        txn: &DatabaseTransaction,
        locking: &Locking,
    ) -> Result<Option<Step<E::Model>>> {
        let Some(guard) = &locking.guard else {
            return Ok(None);
        };
        match guard.verify(txn).await {
            Ok(true) => Ok(None),
            Ok(false) => {
                warn!(row = %self.row.name, fence = locking.report.fence, "lease lost before the write; nothing written");
                crate::metrics::lease_lost(locking.report.backend);
                Ok(Some(Step::Done(Written::LeaseLost)))
            }
            Err(source) => Err(Error::Lock {
                target: self.row.to_string(),
                source,
            }),
        }
    }

    /// Commits a write, with a commit marker when the session writes them: a lost reply is
    /// resolved, never run twice blindly.
    async fn commit(&self, txn: DatabaseTransaction) -> Result<()> {
        crate::commit::commit_write(
            txn,
            self.session.commit_markers(),
            self.session.connection(),
            self.row.name.as_str(),
        )
        .await
    }

    /// Caches `model` as this row's committed state.
    fn cache(&self, model: E::Model) -> Arc<E::Model> {
        let model = Arc::new(model);
        self.session
            .map()
            .insert(self.row.key.clone(), Arc::clone(&model));
        model
    }

    fn version_error(&self, column: &'static str) -> Error {
        Error::VersionColumn {
            entity: E::default().table_name(),
            column,
        }
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

/// The row, read in `txn` (`FOR UPDATE` where the database has it; SQLite's `BEGIN IMMEDIATE`
/// already excludes other writers).
async fn reload_for_update<E: EntityTrait>(
    txn: &DatabaseTransaction,
    pk: &sea_orm::sea_query::ValueTuple,
) -> std::result::Result<Option<E::Model>, DbErr> {
    let mut reload = select_by_key::<E>(pk);
    if txn.get_database_backend() != DbBackend::Sqlite {
        reload = reload.lock_exclusive();
    }
    reload.one(txn).await
}

async fn finish(txn: DatabaseTransaction, commit: bool, row: &Row) -> Result<()> {
    let ended = if commit {
        txn.commit().await
    } else {
        txn.rollback().await
    };
    ended.map_err(|e| database("committing", row, e))
}
