//! Enqueueing: a job to enqueue ([`NewJob`]), and [`enqueue`] / [`enqueue_many`] into the
//! caller's transaction or connection.

use std::time::Duration;

use sea_orm::ConnectionTrait;
use serde::Serialize;

use super::{job::JobId, store};
use crate::error::{Error, Result, database};

/// A job to enqueue, built with [`NewJob::new`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "a job does nothing until it is enqueued"]
pub struct NewJob {
    // Seen by the rest of `jobs` (a periodic kind builds its slots' jobs from them).
    pub(super) kind: String,
    pub(super) payload: String,
    pub(super) key: Option<String>,
    pub(super) unique: Option<String>,
    pub(super) priority: i32,
    pub(super) delay: Duration,
}

impl NewJob {
    /// A job of `kind` carrying `payload` (serialized as JSON now, deserialized by the handler
    /// of `kind` when it runs).
    ///
    /// # Errors
    /// [`Error::InvalidJob`] when `payload` does not serialize (a map with non-string keys, a
    /// `Serialize` impl that fails).
    pub fn new(kind: impl Into<String>, payload: &impl Serialize) -> Result<Self> {
        let kind = kind.into();
        let payload = serde_json::to_string(payload).map_err(|e| Error::InvalidJob {
            kind: kind.clone(),
            reason: format!("the payload does not serialize: {e}"),
        })?;
        Ok(Self {
            kind,
            payload,
            key: None,
            unique: None,
            priority: 0,
            delay: Duration::ZERO,
        })
    }

    crate::setters::setters! {
        /// The serialization key: jobs with the same key run one at a time, in enqueue order (the
        /// field report's `ham_id`).
        key(key: impl Into<String>) => key = Some(key.into());

        /// The unique key: while a job with this unique key has not finished (waiting, running or
        /// waiting for a retry), enqueuing another adds nothing ([`Enqueued::Duplicate`]).
        unique(unique: impl Into<String>) => unique = Some(unique.into());

        /// Higher runs first among due jobs (default 0). Within a key, enqueue order wins.
        priority(priority: i32) => priority = priority;

        /// Due `delay` after the enqueue (on the database's clock), instead of at once.
        delay(delay: Duration) => delay = delay;
    }

    /// The job's kind.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The row the store inserts.
    pub(super) fn insert(&self) -> store::Insert<'_> {
        store::Insert {
            kind: &self.kind,
            payload: &self.payload,
            key: self.key.as_deref(),
            unique: self.unique.as_deref(),
            priority: self.priority,
            delay: self.delay,
        }
    }
}

/// What [`enqueue_many`] did.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnqueuedMany {
    /// Jobs added (they exist once the caller's transaction commits).
    pub added: u64,
    /// Jobs not added: their unique key was held by a job that has not finished, or by an
    /// earlier job of the same call.
    pub duplicates: u64,
}

/// The most jobs one statement of [`enqueue_many`] inserts (ten values each: well within every
/// database's limit on a statement's parameters).
const ENQUEUE_AT_ONCE: usize = 1_000;

/// What [`enqueue`] did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Enqueued {
    /// The job was added (it exists once the caller's transaction commits).
    Added(JobId),
    /// A job with the same unique key has not finished: nothing was added. `existing` is that
    /// job, unless it finished in the meantime.
    Duplicate {
        /// The unfinished job that holds the unique key.
        existing: Option<JobId>,
    },
}

/// Enqueues `jobs` on `db` as [`enqueue`] does each, with one statement per 1,000 jobs instead
/// of one per job: in order (jobs of one key run in the order given), each unique key honoured
/// (a duplicate, of an unfinished job or of an earlier job given here, is not added). In a
/// transaction they are added together or not at all.
///
/// ```
/// use freshlock::jobs::{self, NewJob};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let db = freshlock::testing::TestDatabase::with_migrator::<migration::Migrator>().await?;
/// # let db = db.connection().clone();
/// let batch = (0..20_i64).map(|n| NewJob::new("render", &n).map(|job| job.unique(format!("page:{}", n % 10))));
/// let done = jobs::enqueue_many(&db, batch.collect::<Result<Vec<_>, _>>()?).await?;
/// assert_eq!((done.added, done.duplicates), (10, 10));
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`Error::Database`] when the database fails.
pub async fn enqueue_many(
    db: &impl ConnectionTrait,
    jobs: impl IntoIterator<Item = NewJob>,
) -> Result<EnqueuedMany> {
    let jobs: Vec<NewJob> = jobs.into_iter().collect();
    let mut done = EnqueuedMany::default();
    for chunk in jobs.chunks(ENQUEUE_AT_ONCE) {
        let inserts: Vec<store::Insert<'_>> = chunk.iter().map(NewJob::insert).collect();
        let rows: Vec<&store::Insert<'_>> = inserts.iter().collect();
        let fail = |e| database("enqueuing jobs of", &chunk[0].kind, e);
        let added = store::insert_many(db, &rows).await.map_err(fail)?;
        done.added += added;
        done.duplicates += chunk.len() as u64 - added;
    }
    Ok(done)
}

/// Enqueues `job` on `db`: a transaction (the job exists when it commits, and never if it rolls
/// back) or a connection (the job exists when this returns). A duplicate unique key does not
/// fail the statement, so the caller's transaction goes on either way. Behind a transaction
/// pooler (PgBouncer in transaction mode) enqueue in a transaction, as every statement there.
///
/// # Errors
/// [`Error::Database`] when the database fails (a missing `freshlock_job` table means
/// freshlock's migrations, [`crate::schema::migrations`], were not run).
pub async fn enqueue(db: &impl ConnectionTrait, job: NewJob) -> Result<Enqueued> {
    let insert = job.insert();
    let fail = |e| database("enqueuing a job of", &job.kind, e);
    if let Some(id) = store::insert(db, &insert).await.map_err(fail)? {
        return Ok(Enqueued::Added(id));
    }
    let existing = match job.unique.as_deref() {
        Some(unique) => store::holder_of(db, unique).await.map_err(fail)?,
        None => None,
    };
    Ok(Enqueued::Duplicate { existing })
}
