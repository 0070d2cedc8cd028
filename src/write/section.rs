//! Short transactional sections under one or several keyed locks, for work that is not one
//! row's update: [`Session::with_lock`] and [`Session::section`].

use std::{future::Future, pin::Pin};

use sea_orm::DatabaseTransaction;
use tracing::{Instrument, info_span};

use crate::{
    error::{ApplyError, Error, Result, work_error},
    lock::LockName,
    outcome::LockReport,
    session::Session,
    tx::Tx,
    write::engine::{self, Engine, Fence, Retries, Step, Tried, Worked},
    write::locking::Locking,
};

/// What a locked section did.
#[derive(Debug)]
#[non_exhaustive]
pub enum SectionOutcome<T> {
    /// The section's work was committed; holds what it returned.
    Committed(T),
    /// The lease was lost before the commit (fencing refused): rolled back, nothing written.
    LeaseLost,
}

/// The result of a locked section: the outcome and how the locks went.
#[derive(Debug)]
#[non_exhaustive]
pub struct SectionReport<T> {
    /// What happened.
    pub outcome: SectionOutcome<T>,
    /// How the (first) lock went.
    pub lock: LockReport,
    /// How every lock went, in the order they were taken.
    pub locks: Vec<LockReport>,
    /// How many times the work ran (more than 1 only in a retrying section).
    pub attempts: u32,
    /// How many of those attempts a guard conflict ended.
    pub conflicts: u32,
}

/// The work of a locked section: given the section's transaction, a future of its result.
pub type SectionWork<'t, T> = Pin<Box<dyn Future<Output = Result<T, ApplyError>> + Send + 't>>;

/// A locked section over one or several locks, built by [`Session::section`].
#[derive(Debug)]
#[must_use = "a section does nothing until it is run"]
pub struct Section<'s> {
    session: &'s Session,
    /// Sorted and without duplicates: the canonical order every section takes its locks in.
    locks: Vec<LockName>,
}

impl Session {
    /// Runs `work` in one short transaction under the lock `lock` (for example
    /// [`crate::lock_name::<ham::Entity>(ham_id)`](crate::lock_name)): take the lock under the
    /// session's policy → begin (`BEGIN IMMEDIATE` / `READ COMMITTED`; transaction-scoped
    /// backends lock in it) → `work(&tx)` → check the lease's fence → commit (with its commit
    /// evidence) → apply the section's writes to the cache → release. For work that is not a
    /// single-row update; keep heavy work outside.
    ///
    /// `work` gets the section's [`Tx`]: a sea-orm connection, and [`Tx::repository`] for
    /// repositories bound to the transaction. It is not retried (see
    /// [`Section::run_retrying`] for a section that is).
    ///
    /// # Errors
    /// - What `work` returned: a freshlock [`Error`] or a `sea_orm::DbErr` it returned comes
    ///   back as it is ([`Error::Database`] for the latter, so [`Error::is_transient`] tells a
    ///   deadlock or lock timeout from a lasting failure); any other error as
    ///   [`Error::SectionAborted`], naming the lock. The transaction was rolled back.
    /// - [`Error::LockNotAcquired`] / [`Error::Lock`] when the policy fails without the lock;
    ///   [`Error::Database`] / [`Error::CommitUnknown`] for the section's own statements.
    ///
    /// # Cancel safety
    /// Not the detached kind of `locked_update` (`work` may borrow from the caller): dropping
    /// the future drops the transaction, which rolls back, and the lock, which is released (a
    /// server lease by its guard's background release, or its TTL).
    pub async fn with_lock<T, F>(&self, lock: &LockName, work: F) -> Result<SectionReport<T>>
    where
        T: Send,
        F: for<'t> FnOnce(&'t Tx) -> SectionWork<'t, T> + Send,
    {
        self.section([lock.clone()]).run(work).await
    }

    /// A section under all of `locks` (of rows of one entity or several): they are taken in one
    /// canonical order (sorted by name, duplicates dropped), so two sections locking the same
    /// keys in opposite orders never deadlock — across processes too, with a cross-process
    /// backend. Run it with [`Section::run`] or [`Section::run_retrying`]; a section without any
    /// lock is refused when run ([`Error::Lock`] with [`crate::LockError::EmptyName`]).
    pub fn section(&self, locks: impl IntoIterator<Item = LockName>) -> Section<'_> {
        let mut locks: Vec<_> = locks.into_iter().collect();
        locks.sort();
        locks.dedup();
        Section {
            session: self,
            locks,
        }
    }
}

/// Gives a section's work, kept in a variable before it is run, the type a section takes: a
/// closure infers that its future borrows the [`Tx`] it is given (`for<'t> … -> SectionWork<'t,
/// T>`) only where it is passed to a function that says so, which a `let` does not. Pass the
/// closure through this function where it is written; the result runs with
/// [`Session::with_lock`], [`Section::run`] and [`Section::run_retrying`].
///
/// ```
/// # use entity::node;
/// # use freshlock::{Session, section_work, lock_name};
/// # use migration::Migrator;
/// # use sea_orm::{EntityTrait, IntoActiveModel, Set};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let db = freshlock::testing::TestDatabase::with_migrator::<Migrator>().await?;
/// # let session = Session::new(db.connection().clone());
/// # node::Entity::insert(node::ActiveModel::fresh(1)).exec(db.connection()).await?;
/// let rename = section_work(|tx| {
///     Box::pin(async move {
///         let nodes = tx.repository::<node::Entity>();
///         if let Some(found) = nodes.load(1).await? {
///             let mut node = (*found).clone().into_active_model();
///             node.title = Set("renamed".into());
///             nodes.save(node).await?;
///         }
///         Ok(())
///     })
/// });
/// let key = lock_name::<node::Entity>(1)?;
/// session.section([key]).run_retrying(rename).await?;
/// # let stored = node::Entity::find_by_id(1).one(db.connection()).await?.unwrap();
/// # assert_eq!(stored.title, "renamed");
/// # Ok(())
/// # }
/// ```
pub fn section_work<T, F>(work: F) -> F
where
    F: for<'t> FnMut(&'t Tx) -> SectionWork<'t, T> + Send,
{
    work
}

/// Coerces a closure to the higher-ranked work type (closures infer it only from a bound).
/// `None`: the work cannot run again (a run-once section's work was used).
fn work_fn<T, F>(f: F) -> F
where
    F: for<'t> FnMut(&'t Tx) -> Option<SectionWork<'t, T>> + Send,
{
    f
}

impl Section<'_> {
    /// Runs `work` once, as [`Session::with_lock`] describes, under every lock of the section.
    ///
    /// # Errors
    /// As [`Session::with_lock`].
    pub async fn run<T, F>(self, work: F) -> Result<SectionReport<T>>
    where
        T: Send,
        F: for<'t> FnOnce(&'t Tx) -> SectionWork<'t, T> + Send,
    {
        let mut once = Some(work);
        let work = work_fn(move |tx| once.take().map(|work| work(tx)));
        self.attempts(false, work).await
    }

    /// Runs `work` as [`run`](Self::run) does, and runs it again (in a new transaction, the
    /// locks still held) when it failed with a transient error ([`Error::is_transient`]: a
    /// deadlock, a lock wait timeout, a serialization failure, a busy SQLite, a connection lost
    /// before the commit) or a guard conflict (a guarded write of the attempt returned
    /// `Conflict`, or the work returned [`Error::Conflict`]), up to the policy's `write_attempts`
    /// with a short backoff. Keep `work` free of side effects outside the transaction.
    ///
    /// # Errors
    /// As [`Session::with_lock`]; [`Error::Conflict`] when every attempt conflicted.
    pub async fn run_retrying<T, F>(self, work: F) -> Result<SectionReport<T>>
    where
        T: Send,
        F: for<'t> FnMut(&'t Tx) -> SectionWork<'t, T> + Send,
    {
        let mut work = work;
        self.attempts(true, work_fn(move |tx| Some(work(tx)))).await
    }

    /// The locks' names, joined: the section's name in logs and errors.
    fn label(&self) -> String {
        self.locks
            .iter()
            .map(LockName::as_str)
            .collect::<Vec<_>>()
            .join("+")
    }

    async fn attempts<T, F>(self, retrying: bool, work: F) -> Result<SectionReport<T>>
    where
        T: Send,
        F: for<'t> FnMut(&'t Tx) -> Option<SectionWork<'t, T>> + Send,
    {
        let (session, label) = (self.session, self.label());
        let mut step = Work {
            session,
            label: &label,
            work,
        };
        let ran = self.run_step(retrying, &mut step).await?;
        let lock = ran
            .locks
            .first()
            .cloned()
            .ok_or_else(|| Error::Interrupted {
                target: label.clone(),
            })?;
        Ok(SectionReport {
            outcome: ran.value,
            lock,
            locks: ran.locks,
            attempts: ran.attempts,
            conflicts: ran.conflicts,
        })
    }

    /// Runs `step` on the engine under every lock of the section, taken in its canonical order
    /// and released after the last attempt's transaction ended: the work of a section
    /// ([`Work`]) or a step of its own (`rows_step.rs`). `retrying`: a conflict or a transient
    /// error runs the step again.
    pub(crate) async fn run_step<S: Step>(
        self,
        retrying: bool,
        step: &mut S,
    ) -> Result<Ran<S::Output>> {
        let session = self.session;
        let label = self.label();
        if self.locks.is_empty() {
            // A section under no lock would be an unlocked transaction: refuse it.
            return Err(Error::Lock {
                target: "a section without locks".into(),
                source: crate::error::LockError::EmptyName,
            });
        }
        let span =
            info_span!("locked", lock = %label, backend = session.lock_backend().kind().as_str());
        async move {
            let _in_flight = session.section_started();
            let mut lockings = Vec::with_capacity(self.locks.len());
            for lock in &self.locks {
                let taken = Locking::take(
                    session.lock_backend(),
                    session.policy(),
                    lock,
                    lock.clone(),
                    std::future::pending(),
                    || false,
                )
                .await;
                match taken {
                    Ok(Some(locking)) => lockings.push(locking),
                    Ok(None) | Err(_) => {
                        engine::release_all(lockings).await;
                        return Err(taken.err().unwrap_or_else(|| Error::Interrupted {
                            target: label.clone(),
                        }));
                    }
                }
            }
            let mut retries = Retries::new(
                label.clone(),
                session.policy().write_attempts,
                retrying,
                None,
            );
            let engine = Engine {
                db: session.pool(),
                map: session.map(),
                markers: session.commit_markers(),
            };
            let result = engine::run(engine, &mut lockings, &mut retries, &label, true, step).await;
            // Only now, after commit or rollback.
            let locks = engine::release_all(lockings).await;
            Ok(Ran {
                value: result?,
                locks,
                attempts: retries.attempts,
                conflicts: retries.conflicts,
            })
        }
        .instrument(span)
        .await
    }
}

/// What a step run under a section's locks gave, and how the locks and attempts went.
pub(crate) struct Ran<T> {
    pub(crate) value: T,
    /// How every lock went, in the order they were taken.
    pub(crate) locks: Vec<LockReport>,
    pub(crate) attempts: u32,
    pub(crate) conflicts: u32,
}

/// A section's work as the engine's [`Step`]: the work runs on a [`Tx`] made of the attempt's
/// transaction; what it wrote is committed with the evidence the session takes, every lease
/// checked (and released by the commit where its backend can).
struct Work<'a, F> {
    session: &'a Session,
    label: &'a str,
    work: F,
}

impl<T, F> Step for Work<'_, F>
where
    T: Send,
    F: for<'t> FnMut(&'t Tx) -> Option<SectionWork<'t, T>> + Send,
{
    type Output = SectionOutcome<T>;

    async fn run(
        &mut self,
        txn: DatabaseTransaction,
        _lockings: &mut [Locking],
    ) -> (DatabaseTransaction, Worked<SectionOutcome<T>>) {
        let tx = Tx::new(txn, self.session.clone());
        let worked = match (self.work)(&tx) {
            Some(work) => work.await,
            None => Err(ApplyError::from(Error::Interrupted {
                target: self.label.to_owned(),
            })),
        };
        let (txn, effects, conflicted) = tx.into_parts();
        let txn = txn.into_sea();
        let worked = match worked {
            Ok(value) => Worked::Write {
                value: SectionOutcome::Committed(value),
                evidence: None,
                fence: Fence::Releasing,
                effects,
            },
            Err(source) => Worked::Undone(Tried::Failed {
                error: section_error(self.label, source),
                conflict: conflicted,
            }),
        };
        (txn, worked)
    }

    fn lease_lost(&mut self) -> SectionOutcome<T> {
        SectionOutcome::LeaseLost
    }
}

/// The error a section's work returned, as the caller gets it: freshlock's own errors and
/// database errors as they are, anything else as [`Error::SectionAborted`].
pub(crate) fn section_error(label: &str, error: ApplyError) -> Error {
    work_error("running the locked section", &label, error, |source| {
        Error::SectionAborted {
            lock: label.to_owned(),
            source,
        }
    })
}
