//! The Django report: Spam tasks (children of a Ham) whose updates must be serialized per Ham,
//! pulled by queue workers that may receive a task twice, while other code reads and updates
//! the Hams.
//!
//! One task is [`task`], by a [`Strategy`]: the report's first approach locks the Ham row with
//! the heavy work inside the transaction (and freezes the Ham for everyone); freshlock claims the
//! task with a lease and serializes the two short writes by the Ham's *key*, with the heavy work
//! outside any transaction or lock. [`probe_hot_ham`] is the other code: it locks the hot Ham
//! without waiting and updates it, counting the times the Ham was not available.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use entity::{ham, spam};
use freshlock::claim::{ClaimOutcome, Claims, FinishOutcome};
use freshlock::lock::LockName;
use freshlock::{
    ApplyError, Session, Tx,
    jobs::{self, Enqueued, Finish, Job, Jobs, NewJob, RetryPolicy},
    lock_name,
};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr,
    EntityTrait, PaginatorTrait, QueryFilter, QuerySelect, Set, SqliteTransactionMode,
    TransactionOptions, TransactionTrait,
    sea_query::{LockBehavior, LockType},
};
use tokio::time::Instant;

use crate::{Failure, percentile};

/// How many Hams there are.
pub const HAMS: i32 = 20;

/// The Ham of Spam `spam`: skewed, half of the Spams belong to Ham 1 (the hot Ham).
pub fn ham_of(spam: i32) -> i32 {
    if spam % 2 == 0 {
        1
    } else {
        2 + spam % (HAMS - 1)
    }
}

/// The heavy work the tests give a task: 1–5 ms (the demo's is `--task-ms`, 10–30 ms).
pub const TEST_WORK_MS: (u64, u64) = (1, 5);

/// The heavy work of task `spam`, between `low` and `high` ms, fixed per task.
pub fn heavy_work(spam: i32, (low, high): (u64, u64)) -> Duration {
    let span = high.saturating_sub(low) + 1;
    Duration::from_millis(low + (u64::from(spam.unsigned_abs()) * 7919) % span)
}

/// Empties the Spams, Hams, Ham locks, claims and jobs, then inserts [`HAMS`] Hams and Spams
/// `1..=spams` in state `new`.
///
/// # Errors
/// The database's.
pub async fn seed(db: &impl ConnectionTrait, spams: i32) -> Result<(), DbErr> {
    for table in [
        "spam",
        "ham_lock",
        "ham",
        "freshlock_claim",
        "freshlock_job",
    ] {
        db.execute_unprepared(&format!("DELETE FROM {table}"))
            .await?;
    }
    let hams: Vec<_> = (1..=HAMS)
        .map(|id| ham::ActiveModel {
            id: Set(id),
            name: Set(format!("ham {id}")),
            updated_at: Set(0),
        })
        .collect();
    ham::Entity::insert_many(hams).exec(db).await?;
    let rows: Vec<_> = (1..=spams)
        .map(|id| spam::ActiveModel {
            id: Set(id),
            ham_id: Set(ham_of(id)),
            state: Set("new".into()),
            updated_at: Set(0),
        })
        .collect();
    for chunk in rows.chunks(500) {
        spam::Entity::insert_many(chunk.to_vec()).exec(db).await?;
    }
    Ok(())
}

/// The queue's deliveries: every task once, and every tenth a second time (a queue that
/// retries), last first.
pub fn deliveries(spams: i32) -> Vec<i32> {
    (1..=spams).chain((1..=spams).step_by(10)).collect()
}

/// How many Spams are `done`.
///
/// # Errors
/// The database's.
pub async fn done(db: &impl ConnectionTrait) -> Result<u64, DbErr> {
    spam::Entity::find()
        .filter(spam::Column::State.eq("done"))
        .count(db)
        .await
}

/// How a task is serialized per Ham.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// The report's first approach: `SELECT … FOR UPDATE` of the Ham row, the heavy work inside
    /// that transaction.
    ParentRowLock,
    /// freshlock: claim the task (a lease), new → processing under the Ham's key, heavy work
    /// with nothing held, processing → done under the Ham's key, finish the claim.
    LockRow,
    /// freshlock's keyed jobs: each task a job keyed by its Ham and unique per Spam, claimed
    /// under a lease, worked outside any transaction and finished fenced by the claim
    /// ([`jobs()`]; see [`enqueue`]; not run by [`task`]).
    KeyedJobs,
}

impl Strategy {
    /// The name the demo prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::ParentRowLock => "parent-row-lock",
            Self::LockRow => "lock-row",
            Self::KeyedJobs => "keyed-jobs",
        }
    }
}

/// A worker's tools: its pool, its session (its own cache, the lock backend of the Ham keys) and
/// its claims.
pub struct Worker {
    /// The pool.
    pub db: DatabaseConnection,
    /// The worker's session.
    pub session: Session,
    /// The worker's claims.
    pub claims: Claims,
    /// The heavy work's range, in ms ([`heavy_work`]).
    pub work_ms: (u64, u64),
}

/// Processes delivery `spam` by `strategy`: `Some(time waited for locks)` when this call did
/// the work, `None` when the task was done already or claimed by a live worker (a duplicate
/// delivery).
///
/// # Errors
/// The database's, the lock's, a claim found stale at its finish (work done twice), and
/// [`Strategy::KeyedJobs`], whose tasks a job worker runs.
pub async fn task(
    strategy: Strategy,
    worker: &Worker,
    spam: i32,
) -> Result<Option<Duration>, Failure> {
    match strategy {
        Strategy::ParentRowLock => {
            let txn = begin_writer(&worker.db).await?;
            let Some(row) = spam::Entity::find_by_id(spam).one(&txn).await? else {
                txn.rollback().await?;
                return Ok(None);
            };
            if row.state != "new" {
                txn.rollback().await?;
                return Ok(None);
            }
            let asked = Instant::now();
            ham::Entity::find_by_id(row.ham_id)
                .lock_exclusive()
                .one(&txn)
                .await?;
            let waited = asked.elapsed();
            // The report's long transaction.
            tokio::time::sleep(heavy_work(spam, worker.work_ms)).await;
            spam::Entity::update(spam::ActiveModel {
                id: Set(spam),
                state: Set("done".into()),
                ..Default::default()
            })
            .exec(&txn)
            .await?;
            txn.commit().await?;
            Ok(Some(waited))
        }
        Strategy::LockRow => {
            let name = LockName::new(format!("spam-task:{spam}"))?;
            let ClaimOutcome::Claimed(claim) =
                worker.claims.claim(&name, Duration::from_secs(60)).await?
            else {
                return Ok(None); // done already, or claimed by a live worker
            };
            let spams = worker.session.repository::<spam::Entity>();
            let ham_id = spams.load(spam).await?.ok_or("spam vanished")?.ham_id;
            let ham_key = lock_name::<ham::Entity>(ham_id)?;
            // 1) new → processing, under the Ham's key (not its row).
            let started = spams
                .locked_update_under(ham_key.clone(), spam, |s| {
                    if s.state.as_ref() != "new" {
                        return Err(ApplyError::msg("not new"));
                    }
                    s.state = Set("processing".into());
                    Ok(())
                })
                .await?;
            // 2) heavy work: no transaction, no lock.
            tokio::time::sleep(heavy_work(spam, worker.work_ms)).await;
            // 3) processing → done, under the Ham's key; then the claim.
            let finished = spams
                .locked_update_under(ham_key, spam, |s| {
                    s.state = Set("done".into());
                    Ok(())
                })
                .await?;
            if worker.claims.finish(&claim).await? != FinishOutcome::Finished {
                return Err("a claim was lost: the task may have been done twice".into());
            }
            Ok(Some(started.lock.waited + finished.lock.waited))
        }
        Strategy::KeyedJobs => Err("keyed jobs are run by a job worker, not by `task`".into()),
    }
}

/// Enqueues every delivery of Spams `1..=spams` ([`deliveries`]) as a job of kind `"spam"`, keyed
/// by its Ham and unique per Spam: a second delivery of a Spam whose job has not run yet is a
/// duplicate and adds nothing. Returns how many were added.
///
/// # Errors
/// The database's.
pub async fn enqueue(db: &DatabaseConnection, spams: i32) -> Result<u32, Failure> {
    let txn = db.begin().await?;
    let mut added = 0;
    for spam in deliveries(spams) {
        let job = NewJob::new("spam", &spam)?
            .key(format!("ham:{}", ham_of(spam)))
            .unique(format!("spam:{spam}"));
        if matches!(jobs::enqueue(&txn, job).await?, Enqueued::Added(_)) {
            added += 1;
        }
    }
    txn.commit().await?;
    Ok(added)
}

/// The `"spam"` jobs in the report's own shape: the job is claimed under a 60 s lease (its Ham's
/// key stays busy), the Spam's heavy work (`work`, given the Spam's id; the demo sleeps for
/// [`heavy_work`]) runs outside any transaction while a heartbeat extends the lease, and a short
/// finish, fenced by the claim, marks a Spam still `new` as `done`, its `updated_at` counting
/// the times it was finished (a Spam processed twice would show 2). Each finished Spam is sent
/// to `processed` with the moment its finish ran.
pub fn jobs<W, Fut>(work: W, processed: tokio::sync::mpsc::UnboundedSender<(i32, Instant)>) -> Jobs
where
    W: Fn(i32) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    Jobs::new().handle_leased(
        "spam",
        RetryPolicy::default(),
        Duration::from_secs(60),
        move |job: Job<i32>, _lease| {
            // No transaction, no connection and no lock held: nobody waits on this.
            let worked = work(job.payload);
            async move {
                worked.await;
                Ok(())
            }
        },
        Finished { processed },
    )
}

/// The finish of a `"spam"` job (see [`jobs()`]): new → done, in the fenced transaction.
struct Finished {
    processed: tokio::sync::mpsc::UnboundedSender<(i32, Instant)>,
}

impl Finish<i32, ()> for Finished {
    async fn finish(&self, tx: &Tx, job: Job<i32>, _: &()) -> Result<(), ApplyError> {
        let spam = job.payload;
        let Some(row) = spam::Entity::find_by_id(spam).one(tx).await? else {
            return Ok(());
        };
        if row.state != "new" {
            return Ok(());
        }
        spam::Entity::update(spam::ActiveModel {
            id: Set(spam),
            state: Set("done".into()),
            updated_at: Set(row.updated_at + 1),
            ..Default::default()
        })
        .exec(tx)
        .await?;
        let _ = self.processed.send((spam, Instant::now()));
        Ok(())
    }
}

/// How many Spams were processed more than once by [`jobs()`]' handler (from the database).
///
/// # Errors
/// The database's.
pub async fn processed_twice(db: &impl ConnectionTrait) -> Result<u64, DbErr> {
    spam::Entity::find()
        .filter(spam::Column::UpdatedAt.gt(1))
        .count(db)
        .await
}

/// A writer's transaction: `BEGIN IMMEDIATE` on SQLite (a deferred transaction that reads and
/// then writes fails at once with "database is locked"), a plain `BEGIN` elsewhere.
async fn begin_writer(db: &DatabaseConnection) -> Result<DatabaseTransaction, DbErr> {
    if db.get_database_backend() == DbBackend::Sqlite {
        db.begin_with_options(TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..Default::default()
        })
        .await
    } else {
        db.begin().await
    }
}

/// What [`probe_hot_ham`] saw of the hot Ham while the workers ran.
#[derive(Debug, Default)]
pub struct Probes {
    /// Time per lock + update of the Ham, for the updates that went through.
    pub latencies: Vec<Duration>,
    /// Updates refused because the Ham row was locked (`FOR UPDATE NOWAIT` failed; SQLite has
    /// no row locks: there the probe waits for the database instead).
    pub refused: u32,
}

impl Probes {
    /// The `p`th percentile of the latencies (see [`percentile`]).
    pub fn percentile(&mut self, p: usize) -> Duration {
        percentile(&mut self.latencies, p)
    }
}

/// Locks the hot Ham (Ham 1) without waiting, then updates it, every 5 ms until `stop`.
///
/// # Errors
/// The database's (other than the refused lock).
pub async fn probe_hot_ham(db: DatabaseConnection, stop: Arc<AtomicBool>) -> Result<Probes, DbErr> {
    let mut probes = Probes::default();
    while !stop.load(Ordering::SeqCst) {
        let started = Instant::now();
        let txn = begin_writer(&db).await?;
        let locked = ham::Entity::find_by_id(1)
            .lock_with_behavior(LockType::Update, LockBehavior::Nowait)
            .one(&txn)
            .await;
        if locked.is_err() {
            probes.refused += 1;
            txn.rollback().await?;
        } else {
            ham::Entity::update(ham::ActiveModel {
                id: Set(1),
                name: Set("ham 1 (edited)".into()),
                ..Default::default()
            })
            .exec(&txn)
            .await?;
            txn.commit().await?;
            probes.latencies.push(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(probes)
}
