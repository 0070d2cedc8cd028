//! What the queue holds, as an operator or a test reads it: its depth per kind and key, and
//! the jobs themselves, filtered by kind, key and state, on any connection.

use sea_orm::{ConnectionTrait, DbBackend, DbErr, QueryResult, Value};

use super::{job::JobId, state::Stored, store};
use crate::{
    database::Db,
    db::{
        autocommit::autocommit,
        deadline::{Bounded, DEFAULT_REPLY},
        pool::Pool,
    },
    error::{Result, database},
    lock::sql::{now_ms, statement},
    schema::JOB_TABLE,
};

/// A job's state as stored.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum JobState {
    /// Waiting to run (also while it runs in a worker's transaction, its row locked there, and
    /// while it waits for a retry).
    Waiting,
    /// Claimed by a worker under a lease, its work running outside any transaction
    /// ([`Jobs::handle_leased`](super::Jobs::handle_leased)); it waits again if the lease
    /// expires.
    Leased,
    /// Completed: its handler's writes committed with it.
    Done,
    /// Failed for good, its error kept ([`retry`](super::retry) makes it wait again).
    Failed,
    /// Discarded by an operator before it ran ([`discard`](super::discard)).
    Discarded,
    /// Cancelled ([`cancel`](super::cancel)) before it ran, or while it ran: its writes rolled
    /// back, or its leased work's finish refused.
    Cancelled,
}

impl JobState {
    /// The stored states it covers (waiting: due or queued behind its key).
    fn codes(self) -> &'static [Stored] {
        match self {
            Self::Waiting => &[Stored::Pending, Stored::Queued],
            Self::Leased => &[Stored::Leased],
            Self::Done => &[Stored::Done],
            Self::Failed => &[Stored::Failed],
            Self::Discarded => &[Stored::Discarded],
            Self::Cancelled => &[Stored::Cancelled],
        }
    }

    fn from_stored(code: i16) -> Option<Self> {
        Some(match Stored::from_code(code)? {
            Stored::Pending | Stored::Queued => Self::Waiting,
            Stored::Leased => Self::Leased,
            Stored::Done => Self::Done,
            Stored::Failed => Self::Failed,
            Stored::Discarded => Self::Discarded,
            Stored::Cancelled => Self::Cancelled,
        })
    }

    /// The state's name: `waiting`, `leased`, `done`, `failed`, `discarded`, `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Leased => "leased",
            Self::Done => "done",
            Self::Failed => "failed",
            Self::Discarded => "discarded",
            Self::Cancelled => "cancelled",
        }
    }
}

/// The queue's depth for one kind and key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Depth {
    /// The jobs' kind.
    pub kind: String,
    /// Their serialization key (`None`: jobs without one).
    pub key: Option<String>,
    /// Jobs waiting to run (due or not, running included, leased ones too).
    pub waiting: u64,
    /// Of those, the ones that can run now: due, and not behind an earlier job of their key.
    pub due: u64,
    /// Jobs failed for good.
    pub failed: u64,
    /// Whether a running worker ([`Worker::run`](super::Worker::run)) takes this kind: it said
    /// so within the last 30 s. `false`: the kind's jobs wait for a worker that has its handler
    /// (a service not deployed yet, a queue without workers).
    pub handled: bool,
}

/// One job, as [`list`] and [`JobFilter::list`] show it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobInfo {
    /// The job's id.
    pub id: JobId,
    /// Its kind.
    pub kind: String,
    /// Its serialization key.
    pub key: Option<String>,
    /// Its unique key.
    pub unique: Option<String>,
    /// Its state.
    pub state: JobState,
    /// Attempts made.
    pub attempts: i32,
    /// Its priority.
    pub priority: i32,
    /// When it was enqueued, in milliseconds since the Unix epoch (database clock).
    pub created_at_ms: i64,
    /// When it is (or was) due, in milliseconds since the Unix epoch (database clock).
    pub run_at_ms: i64,
    /// When it finished (done, failed or discarded), in milliseconds since the Unix epoch
    /// (database clock).
    pub finished_at_ms: Option<i64>,
    /// The error of its last failed attempt.
    pub last_error: Option<String>,
}

/// Which jobs [`JobFilter::list`] and [`JobFilter::depth`] read: any kind, key and state unless
/// set. Reads on any connection — a pool, a transaction (your test's, your handler's `Tx`) —
/// each round trip bounded by 10 s. Behind a transaction pooler a read on the pool itself is a
/// statement of yours outside a transaction (see `freshlock::transaction_pooler`): read in a
/// transaction, or through [`list`](super::list) and [`depth`](super::depth) with the adopted
/// handle, which wrap their statement.
///
/// ```
/// use freshlock::jobs::{self, JobFilter, JobState, NewJob};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let db = freshlock::testing::TestDatabase::with_migrator::<migration::Migrator>().await?;
/// # let db = db.connection().clone();
/// jobs::enqueue(&db, NewJob::new("fulfil", &7_i64)?.key("product:7")).await?;
/// jobs::enqueue(&db, NewJob::new("fulfil", &8_i64)?.key("product:8")).await?;
/// let waiting = JobFilter::new()
///     .kind("fulfil")
///     .key("product:7")
///     .state(JobState::Waiting)
///     .list(&db, 10)
///     .await?;
/// assert_eq!(waiting.len(), 1);
/// assert_eq!(waiting[0].key.as_deref(), Some("product:7"));
/// let depth = JobFilter::new().kind("fulfil").depth(&db).await?;
/// assert_eq!(depth.iter().map(|d| d.waiting).sum::<u64>(), 2);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[must_use = "a filter reads nothing until `list` or `depth` is called"]
pub struct JobFilter {
    kind: Option<String>,
    key: Option<String>,
    state: Option<JobState>,
}

impl JobFilter {
    /// Every job.
    pub fn new() -> Self {
        Self::default()
    }

    crate::setters::setters! {
        /// Only jobs of `kind`.
        kind(kind: impl Into<String>) => kind = Some(kind.into());

        /// Only jobs of serialization key `key`.
        key(key: impl Into<String>) => key = Some(key.into());

        /// Only jobs in `state` (a waiting job may be queued behind another of its key: still
        /// [`JobState::Waiting`]).
        state(state: JobState) => state = Some(state);
    }

    /// Up to `limit` jobs that match, oldest first.
    ///
    /// # Errors
    /// [`crate::Error::Database`] when the query fails.
    pub async fn list(&self, db: &impl ConnectionTrait, limit: u64) -> Result<Vec<JobInfo>> {
        let db = &Bounded::new(db, DEFAULT_REPLY);
        let backend = db.get_database_backend();
        let (condition, mut values) = self.condition(&[]);
        let sql = format!(
            "SELECT id, kind, job_key, unique_key, state, attempts, priority, created_at, \
             run_at, finished_at, last_error FROM {JOB_TABLE} WHERE {condition} \
             ORDER BY id LIMIT ?"
        );
        values.push(i64::try_from(limit).unwrap_or(i64::MAX).into());
        read_all(db, "listing", statement(backend, &sql, values), |row| {
            let stored: i16 = row.try_get("", "state")?;
            Ok(JobInfo {
                id: row.try_get("", "id")?,
                kind: text(row.try_get("", "kind")?).unwrap_or_default(),
                key: text(row.try_get("", "job_key")?),
                unique: text(row.try_get("", "unique_key")?),
                attempts: row.try_get("", "attempts")?,
                priority: row.try_get("", "priority")?,
                state: JobState::from_stored(stored).unwrap_or(JobState::Waiting),
                created_at_ms: row.try_get("", "created_at")?,
                run_at_ms: row.try_get("", "run_at")?,
                finished_at_ms: row.try_get("", "finished_at")?,
                last_error: row.try_get("", "last_error")?,
            })
        })
        .await
    }

    /// The depth of the queue per kind and key, of the jobs that match (unfinished and failed
    /// ones unless a state is set): jobs waiting (and due) and failed, by kind, then by key.
    /// Kinds and keys are told apart byte for byte, at any length.
    ///
    /// # Errors
    /// [`crate::Error::Database`] when the query fails.
    pub async fn depth(&self, db: &impl ConnectionTrait) -> Result<Vec<Depth>> {
        self.depth_by(db, true).await
    }

    /// [`depth`](Self::depth) by kind and key (`by_key`), or by kind only: one row a kind, its
    /// keys summed by the database (the worker's gauge: a queue of 500,000 jobs over 100,000
    /// keys is 100,000 rows by key — 0.37–0.45 s on PostgreSQL here, 1.45–1.54 s on MariaDB —
    /// and one row by kind, 0.05 s / 0.89 s).
    pub(super) async fn depth_by(
        &self,
        db: &impl ConnectionTrait,
        by_key: bool,
    ) -> Result<Vec<Depth>> {
        let db = &Bounded::new(db, DEFAULT_REPLY);
        let backend = db.get_database_backend();
        let now = now_ms(backend);
        let bigint = if backend == DbBackend::MySql {
            "SIGNED"
        } else {
            "BIGINT"
        };
        let (pending, queued, failed) = (Stored::Pending, Stored::Queued, Stored::Failed);
        let leased = Stored::Leased;
        let sum = |condition: &str| {
            format!("CAST(SUM(CASE WHEN {condition} THEN 1 ELSE 0 END) AS {bigint})")
        };
        // MySQL/MariaDB group and sort a long binary value by its first `max_sort_length` bytes
        // (1,024) only: the kind's SHA-256 keeps two kinds that share those apart, and next to
        // their own rows in the order (`record_depth` sums adjacent rows). Keys go by
        // `key_hash`.
        let kind = if backend == DbBackend::MySql {
            "kind, SHA2(kind, 256)"
        } else {
            "kind"
        };
        let (key, group, order) = match by_key {
            true => (
                ", job_key",
                format!("{kind}, key_hash, job_key"),
                format!("{kind}, key_hash"),
            ),
            false => ("", kind.to_owned(), kind.to_owned()),
        };
        let (condition, values) = self.condition(&[pending, leased, queued, failed]);
        let sql = format!(
            "SELECT kind{key}, {waiting} AS waiting, {due} AS due, {failed_n} AS failed \
             FROM {JOB_TABLE} WHERE {condition} GROUP BY {group} ORDER BY {order}",
            waiting = sum(&format!("state IN ({pending}, {leased}, {queued})")),
            due = sum(&format!("state = {pending} AND run_at <= {now}")),
            failed_n = sum(&format!("state = {failed}")),
        );
        let taken = (store::taken(db).await)
            .map_err(|e| database("reading the kinds workers take from", &JOB_TABLE, e))?;
        read_all(
            db,
            "reading the depth of",
            statement(backend, &sql, values),
            |row| {
                let kind: Option<Vec<u8>> = row.try_get("", "kind")?;
                let key = match by_key {
                    true => text(row.try_get("", "job_key")?),
                    false => None,
                };
                Ok(Depth {
                    handled: kind.as_ref().is_some_and(|kind| taken.contains(kind)),
                    kind: text(kind).unwrap_or_default(),
                    key,
                    waiting: count(row, "waiting")?,
                    due: count(row, "due")?,
                    failed: count(row, "failed")?,
                })
            },
        )
        .await
    }

    /// The filter's condition and its values: the state's codes (else `states`, or any state
    /// when that is empty), the kind, the key's hash.
    fn condition(&self, states: &[Stored]) -> (String, Vec<Value>) {
        let mut states = states.to_vec();
        if let Some(state) = self.state {
            states = state.codes().to_vec();
        }
        let mut parts = Vec::new();
        let mut values = Vec::new();
        if !states.is_empty() {
            parts.push(format!("state IN ({})", vec!["?"; states.len()].join(", ")));
            values.extend(states.into_iter().map(Value::from));
        }
        if let Some(kind) = &self.kind {
            parts.push("kind = ?".to_owned());
            values.push(store::bytes(Some(kind)));
        }
        if let Some(key) = &self.key {
            parts.push("key_hash = ?".to_owned());
            values.push(store::hashed(key));
        }
        if parts.is_empty() {
            parts.push("1 = 1".to_owned());
        }
        (parts.join(" AND "), values)
    }
}

/// The rows of `query`, each read by `read` (a failure is `operation`'s on the job table).
async fn read_all<T>(
    db: &impl ConnectionTrait,
    operation: &'static str,
    query: sea_orm::Statement,
    read: impl Fn(&QueryResult) -> std::result::Result<T, DbErr>,
) -> Result<Vec<T>> {
    let fail = |e| database(operation, &JOB_TABLE, e);
    let rows = db.query_all_raw(query).await.map_err(fail)?;
    rows.iter()
        .map(read)
        .collect::<std::result::Result<_, _>>()
        .map_err(fail)
}

pub(super) fn text(bytes: Option<Vec<u8>>) -> Option<String> {
    bytes.map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn count(row: &QueryResult, column: &str) -> std::result::Result<u64, DbErr> {
    let n: Option<i64> = row.try_get("", column)?;
    Ok(u64::try_from(n.unwrap_or(0)).unwrap_or(0))
}

/// The depth of the queue per kind and key: jobs waiting (and due) and failed, by kind, then
/// by key (every kind and key: [`JobFilter::depth`] reads some, on any connection).
///
/// # Errors
/// [`crate::Error::Database`] when the query fails.
pub async fn depth(db: impl Into<Db>) -> Result<Vec<Depth>> {
    // One statement of its own (in a transaction behind a transaction pooler).
    let db = db.into();
    JobFilter::new().depth(&autocommit(db.pool())).await
}

/// Reads the queue's [`depth`] and sets the `freshlock_job_depth` gauge per kind and state
/// (`waiting`, `due`, `failed`, and `no_worker`: waiting jobs of a kind no running worker takes;
/// summed over keys; a kind no longer in the queue goes to 0) —
/// with the `metrics` feature; without it, this only reads. [`Worker::run`](super::Worker::run)
/// sets the same gauge every 10 s (one of a worker's clones; by kind only, in a task of its own
/// that its loop does not wait for), so a service that runs workers need not.
///
/// # Errors
/// As [`depth`].
pub async fn record_depth(db: impl Into<Db>) -> Result<Vec<Depth>> {
    let depths = depth(db).await?;
    gauge(&depths);
    Ok(depths)
}

/// [`record_depth`] as a running worker records it: the depth by kind only (the database sums
/// the keys: see [`JobFilter::depth_by`]).
pub(super) async fn record_kind_depth(db: &Pool) -> Result<()> {
    let depths = JobFilter::new().depth_by(&autocommit(db), false).await?;
    gauge(&depths);
    Ok(())
}

/// Sets the depth gauge per kind from `depths` (ordered by kind; a kind's rows summed).
fn gauge(depths: &[Depth]) {
    let mut per_kind: Vec<crate::metrics::KindDepth> = Vec::new();
    for d in depths {
        let no_worker = if d.handled { 0 } else { d.waiting };
        match per_kind.last_mut() {
            // `depth` is ordered by kind.
            Some(last) if last.kind == d.kind => {
                last.waiting += d.waiting;
                last.due += d.due;
                last.failed += d.failed;
                last.no_worker += no_worker;
            }
            _ => per_kind.push(crate::metrics::KindDepth {
                kind: d.kind.clone(),
                waiting: d.waiting,
                due: d.due,
                failed: d.failed,
                no_worker,
            }),
        }
    }
    crate::metrics::job_depth(&per_kind);
}

/// Up to `limit` jobs in `state`, oldest first ([`JobFilter::list`] filters by kind and key
/// too, on any connection).
///
/// # Errors
/// [`crate::Error::Database`] when the query fails.
pub async fn list(db: impl Into<Db>, state: JobState, limit: u64) -> Result<Vec<JobInfo>> {
    let db = db.into();
    let filter = JobFilter::new().state(state);
    filter.list(&autocommit(db.pool()), limit).await
}
