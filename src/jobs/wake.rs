//! Waking idle workers: on PostgreSQL an enqueue's statement also sends `NOTIFY freshlock_job`
//! (delivered when its transaction commits, `store::insert`), and a worker's [`Worker::run`]
//! (`super::Worker::run`) listens on a connection of its own, so an idle worker takes a new job
//! at once instead of at its next poll. Polling stays as the fallback: a notification lost
//! while the listening connection reconnects costs one poll interval, never a job. Not on
//! MySQL/MariaDB and SQLite (no `LISTEN`), nor behind a transaction pooler (a `LISTEN` would be
//! lost with its server connection at the end of its transaction): workers poll there.

use std::sync::Arc;

use crate::db::pool::Pool;
use tokio::sync::{Notify, OnceCell};

/// The channel an enqueue notifies.
pub(super) const CHANNEL: &str = "freshlock_job";

/// A worker's listener, started by its first [`Worker::run`](super::Worker::run) and shared by
/// its clones; it stops when the last clone is dropped.
#[derive(Debug, Default)]
pub(super) struct Wakeup {
    listening: OnceCell<Option<Listening>>,
}

#[derive(Debug)]
struct Listening {
    notify: Arc<Notify>,
    _task: AbortOnDrop,
}

/// Aborts the listening task with the last worker.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Wakeup {
    /// What an enqueue's notification wakes: `None` where workers only poll.
    pub(super) async fn notify(&self, db: &Pool) -> Option<Arc<Notify>> {
        let listening = self.listening.get_or_init(|| listen(db)).await;
        listening.as_ref().map(|l| Arc::clone(&l.notify))
    }
}

#[cfg(feature = "postgres")]
async fn listen(db: &Pool) -> Option<Listening> {
    use sea_orm::{DatabaseConnectionType, sqlx};
    use tracing::{debug, warn};

    if !matches!(
        db.inner,
        DatabaseConnectionType::SqlxPostgresPoolConnection(_)
    ) || db.transaction_pooled()
    {
        return None;
    }
    // A connection of its own, so that the application's pool keeps its size.
    let options = db.get_postgres_connection_pool().connect_options();
    let own = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with((*options).clone());
    let listener = async {
        let mut listener = sqlx::postgres::PgListener::connect_with(&own).await?;
        listener.listen(CHANNEL).await?;
        Ok::<_, sqlx::Error>(listener)
    };
    let mut listener = match listener.await {
        Ok(listener) => listener,
        Err(error) => {
            warn!(%error, "listening for enqueued jobs failed; the workers poll");
            return None;
        }
    };
    let notify = Arc::new(Notify::new());
    let wake = Arc::clone(&notify);
    let task = tokio::spawn(async move {
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => wake.notify_waiters(),
                // Reconnecting: a notification may have been lost, so look now.
                Ok(None) => {
                    debug!("the job listener reconnects");
                    wake.notify_waiters();
                }
                Err(error) => {
                    warn!(%error, "the job listener failed; the workers poll until it is back");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            }
        }
    });
    Some(Listening {
        notify,
        _task: AbortOnDrop(task),
    })
}

#[cfg(not(feature = "postgres"))]
async fn listen(_db: &Pool) -> Option<Listening> {
    None
}
