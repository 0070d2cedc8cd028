//! Cancelling jobs: [`cancel`] for an operator or an application, and the worker's half — an
//! attempt whose completion found a request to stop its jobs rolled back, and the next attempt
//! marks them cancelled instead of running them again.

use sea_orm::ConnectionTrait;

use super::{
    admin::decided,
    job::{JobId, JobOutcome, JobRun},
    step::{Attempted, JobStep, Measured},
    store::{self, Found},
};
use crate::{
    database::Db,
    db::{deadline::Bounded, txn::Txn},
    error::Result,
    write::engine::{Fence, Worked},
};

/// What [`cancel`] did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cancel {
    /// The job was waiting, or leased (its work running outside any transaction): it is
    /// cancelled now. A leased job's [`Lease`](super::Lease) reports it lost, and its finish is
    /// refused. The next job of its key may run.
    Cancelled,
    /// The job is running in a worker's transaction: it is asked to stop. Its transaction rolls
    /// back when its handler returns, and the job ends [`JobState::Cancelled`](super::JobState)
    /// without running again — unless it committed first, which [`super::list`] shows.
    Requested,
    /// The job had finished (done, failed, discarded, cancelled), or there is no such job.
    Finished,
}

/// Cancels job `id`: at once when nobody is running it (waiting, or leased: its work outside
/// any transaction is told through its [`Lease`](super::Lease)); by a request that its
/// worker's completion reads when it runs in a worker's transaction.
///
/// On SQLite a running job's transaction holds the database's one write lock: `cancel` waits
/// for it to end, so a job running in its transaction there is [`Cancel::Finished`] (or
/// cancelled, if it failed and waits for a retry).
///
/// ```
/// use freshlock::jobs::{self, Cancel, JobFilter, JobState, NewJob};
/// # use migration::Migrator;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let test = freshlock::testing::TestDatabase::with_migrator::<Migrator>().await?;
/// # let db = test.connection().clone();
/// let added = jobs::enqueue(&db, NewJob::new("email", &"a@b.c")?).await?;
/// let jobs::Enqueued::Added(id) = added else { unreachable!("no unique key") };
/// assert_eq!(jobs::cancel(&db, id).await?, Cancel::Cancelled);
/// assert_eq!(jobs::cancel(&db, id).await?, Cancel::Finished);
/// let cancelled = JobFilter::new().state(JobState::Cancelled).list(&db, 10).await?;
/// assert_eq!(cancelled[0].id, id);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`crate::Error::Database`] when the database fails.
pub async fn cancel(db: impl Into<Db>, id: JobId) -> Result<Cancel> {
    decided(
        db,
        "cancelling a job of",
        |txn| Box::pin(cancel_in(txn, id)),
        |_| true,
    )
    .await
}

/// [`cancel`] in `txn`.
async fn cancel_in(
    txn: &impl ConnectionTrait,
    id: JobId,
) -> std::result::Result<Cancel, sea_orm::DbErr> {
    match store::look(txn, id).await? {
        Found::Finished => Ok(Cancel::Finished),
        Found::Busy => {
            store::request(txn, id).await?;
            Ok(Cancel::Requested)
        }
        Found::Free => {
            let Some(cancelled) = store::cancel(txn, id).await? else {
                return Ok(Cancel::Finished);
            };
            store::promote(txn, cancelled.key_hash.into_iter().collect(), &[]).await?;
            Ok(Cancel::Cancelled)
        }
    }
}

impl JobStep<'_> {
    /// Marks the jobs in `self.cancelling` cancelled, in `txn`, and readies their keys' next
    /// jobs: the attempt before this one ran them, and its completion found them asked to stop.
    pub(super) async fn cancel_requested(&mut self, txn: Txn) -> Attempted {
        let ids = std::mem::take(&mut self.cancelling);
        let bounded = Bounded::new(&txn, self.cx.reply());
        let mut runs = Vec::with_capacity(ids.len());
        let mut keys = Vec::new();
        for id in ids {
            let cancelled = match store::cancel(&bounded, id).await {
                Ok(Some(cancelled)) => cancelled,
                // Finished meanwhile (another worker ran it again and it committed first).
                Ok(None) => continue,
                Err(e) => return super::step::undone(txn, ("cancelling a job of", e)),
            };
            let kind = String::from_utf8_lossy(&cancelled.kind).into_owned();
            self.measured.push(Measured {
                kind: kind.clone(),
                outcome: JobOutcome::Cancelled.name(),
                waited: std::time::Duration::ZERO,
                ran: std::time::Duration::ZERO,
                ended_on: None,
            });
            keys.extend(cancelled.key_hash);
            runs.push(JobRun {
                id,
                kind,
                attempt: u32::try_from(cancelled.attempts).unwrap_or(0) + 1,
                outcome: JobOutcome::Cancelled,
            });
        }
        if let Err(e) = store::promote(&bounded, keys, &[]).await {
            return super::step::undone(txn, ("readying the next jobs of", e));
        }
        let worked = Worked::Write {
            value: runs,
            evidence: None,
            fence: Fence::Unchecked,
            effects: Vec::new(),
        };
        (txn, worked)
    }
}
