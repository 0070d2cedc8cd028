//! The Drupal report: four queue workers each load one node, do heavy work, set *their own*
//! field and save. `save()` writes every column, so each worker erases the others' results.
//!
//! One job is [`job`]: load the node (a fresh read, as a new job's first load is), do the heavy
//! work, write the job's field by a [`Strategy`]. The drivers choose how jobs are spread over
//! workers; [`lost_fields`] counts afterwards what the strategy lost.

use std::time::Duration;

use entity::node;
use freshlock::Session;
use freshlock::lock::backend::LeaseLock;
use freshlock::lock::{LocalLock, LockName};
use sea_orm::{ActiveModelTrait, ConnectionTrait, DbErr, EntityTrait, IntoActiveModel, Set};
use tokio::time::Instant;

use crate::Failure;

/// A worker's field: each worker kind writes one column of the node.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Field {
    /// `node.thumbnail`.
    Thumbnail,
    /// `node.summary`.
    Summary,
    /// `node.score`.
    Score,
    /// `node.analysis`.
    Analysis,
}

impl Field {
    /// The four fields, in the order of the columns.
    pub const ALL: [Field; 4] = [
        Field::Thumbnail,
        Field::Summary,
        Field::Score,
        Field::Analysis,
    ];

    /// The column's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Thumbnail => "thumbnail",
            Self::Summary => "summary",
            Self::Score => "score",
            Self::Analysis => "analysis",
        }
    }

    /// Sets this field of node `id` to the value its worker computes (one value per field and
    /// node, so the row tells whether the write survived).
    pub fn set(self, n: &mut node::ActiveModel, id: i32) {
        let text = Some(format!("{} of node {id}", self.name()));
        match self {
            Self::Thumbnail => n.thumbnail = Set(text),
            Self::Summary => n.summary = Set(text),
            Self::Score => n.score = Set(Some(id)),
            Self::Analysis => n.analysis = Set(text),
        }
    }

    /// Whether `row` holds the value this field's worker writes.
    pub fn holds(self, row: &node::Model) -> bool {
        let text = format!("{} of node {}", self.name(), row.id);
        match self {
            Self::Thumbnail => row.thumbnail.as_deref() == Some(&text),
            Self::Summary => row.summary.as_deref() == Some(&text),
            Self::Score => row.score == Some(row.id),
            Self::Analysis => row.analysis.as_deref() == Some(&text),
        }
    }
}

/// Empties `node` and inserts nodes `1..=nodes` as created (a title, every field empty).
///
/// # Errors
/// The database's.
pub async fn seed(db: &impl ConnectionTrait, nodes: i32) -> Result<(), DbErr> {
    node::Entity::delete_many().exec(db).await?;
    let rows: Vec<_> = (1..=nodes).map(node::ActiveModel::fresh).collect();
    for chunk in rows.chunks(500) {
        node::Entity::insert_many(chunk.to_vec()).exec(db).await?;
    }
    Ok(())
}

/// How many fields of `node` do not hold what their worker wrote: the lost updates, when every
/// field of every node was written (with several writers per field: a lower bound).
///
/// # Errors
/// The database's.
pub async fn lost_fields(db: &impl ConnectionTrait) -> Result<usize, DbErr> {
    Ok(node::Entity::find()
        .all(db)
        .await?
        .iter()
        .map(|row| Field::ALL.iter().filter(|f| !f.holds(row)).count())
        .sum())
}

/// How a job writes its field.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// The report's code: load → work → `save()` of every column. Loses updates.
    Naive,
    /// The report's first fix: load → work → lock → "reload" (from the session's cache) →
    /// save every column → release. Still loses updates: the reload is the stale snapshot.
    StaleReload,
    /// Lock → load from the database → work → save every column → release: correct, but the
    /// heavy work runs inside the lock, so writers of one node queue behind each other's work.
    LockAroundWork,
    /// freshlock: load → work → `locked_update` of the one field (reloaded under the lock,
    /// only the dirty column written).
    Freshlock,
}

impl Strategy {
    /// The name the demo and the benchmarks print.
    pub fn name(self) -> &'static str {
        match self {
            Self::Naive => "naive",
            Self::StaleReload => "stale-reload",
            Self::LockAroundWork => "lock-around-work",
            Self::Freshlock => "freshlock",
        }
    }
}

/// One job: `field` of node `id`, with `work` of heavy work, written by `strategy` through the
/// worker's `session`; `lock` is the lock the hand-made strategies take (shared by all workers).
/// Returns the time spent waiting for a lock.
///
/// # Errors
/// The database's, the lock's, and "node vanished".
pub async fn job(
    strategy: Strategy,
    session: &Session,
    lock: &LocalLock,
    id: i32,
    field: Field,
    work: Duration,
) -> Result<Duration, Failure> {
    let repo = session.repository::<node::Entity>();
    // A new job's first load reads the database (a fresh request, a fresh worker process).
    repo.reset_cache([id])?;
    let name = LockName::new(format!("node:{id}"))?;
    let (lock_wait, lock_ttl) = (Duration::from_secs(600), Duration::from_secs(60));
    let save_whole = |loaded: &node::Model| {
        let mut whole = loaded.clone().into_active_model().reset_all();
        field.set(&mut whole, id);
        whole
    };
    match strategy {
        Strategy::Naive => {
            let loaded = repo.load(id).await?.ok_or("node vanished")?;
            tokio::time::sleep(work).await;
            save_whole(&loaded).update(session.connection()).await?;
            Ok(Duration::ZERO)
        }
        Strategy::StaleReload => {
            repo.load(id).await?.ok_or("node vanished")?;
            tokio::time::sleep(work).await;
            let asked = Instant::now();
            let guard = lock.acquire(&name, lock_wait, lock_ttl).await?;
            let waited = asked.elapsed();
            let guard = guard.ok_or("lock not taken")?;
            // The "reload" comes from the session's cache: the snapshot of before the work.
            let reloaded = repo.load(id).await?.ok_or("node vanished")?;
            let saved = save_whole(&reloaded).update(session.connection()).await;
            guard.release().await?;
            saved?;
            Ok(waited)
        }
        Strategy::LockAroundWork => {
            let asked = Instant::now();
            let guard = lock.acquire(&name, lock_wait, lock_ttl).await?;
            let waited = asked.elapsed();
            let guard = guard.ok_or("lock not taken")?;
            let written = async {
                let loaded = repo.load(id).await?.ok_or("node vanished")?;
                tokio::time::sleep(work).await;
                save_whole(&loaded).update(session.connection()).await?;
                Ok::<_, Failure>(())
            }
            .await;
            guard.release().await?;
            written?;
            Ok(waited)
        }
        Strategy::Freshlock => {
            repo.load(id).await?.ok_or("node vanished")?;
            tokio::time::sleep(work).await;
            let report = repo
                .locked_update(id, |n| {
                    field.set(n, id);
                    Ok(())
                })
                .await?;
            Ok(report.lock.waited)
        }
    }
}
