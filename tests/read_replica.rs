//! `SessionBuilder::read_from`: loads from a real PostgreSQL streaming replica, everything that
//! must be current from the primary.
//!
//! A private primary on its own port and a replica made from it with `pg_basebackup -R` (the
//! shared server is never touched). The replica is made stale on purpose by pausing its WAL
//! replay (`pg_wal_replay_pause()`), so the staleness is certain, not a race:
//! - `load` reads the replica (it returns the stale row), `load_fresh` the primary;
//! - a guarded `save` based on the stale read is `Conflict`: the primary keeps the other write;
//! - `locked_update` reloads on the primary under the lock: nothing lost;
//! - 4 tasks × 25 `load` + `locked_update` increments through replica-reading sessions while
//!   replay runs: the row holds exactly the acknowledged increments;
//! - a replica of another kind of database is refused when the session is built.
//!
//! Needs root (to run initdb / pg_basebackup as `postgres`), as `.ci/run` has; it runs where
//! `DATABASE_URL_POSTGRES` is set (the server suites), and says so and skips elsewhere.
#![cfg(feature = "postgres")]

mod common;
#[path = "common/private_pg.rs"]
mod private_pg;
#[path = "common/servers.rs"]
mod servers;

use std::{sync::Arc, time::Duration};

use entity::node;
use freshlock::lock::LocalLock;
use freshlock::{Error, SaveOutcome, Session};
use migration::{Migrator, MigratorTrait};
use private_pg::PrivatePostgres;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, EntityTrait,
    IntoActiveModel, Set, Statement,
};

async fn connect(url: &str) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url);
    options.max_connections(8).sqlx_logging(false);
    Database::connect(options).await.expect("connect")
}

async fn score(db: &DatabaseConnection, id: i32) -> Option<i32> {
    node::Entity::find_by_id(id)
        .one(db)
        .await
        .expect("read")
        .and_then(|n| n.score)
}

async fn sql_text(db: &DatabaseConnection, sql: &str) -> String {
    db.query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .expect(sql)
        .expect("a row")
        .try_get_by_index::<String>(0)
        .unwrap_or_default()
}

/// Polls until `condition` holds; fails after 30 s instead of hanging.
async fn eventually<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !condition().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn reading(
    primary: &DatabaseConnection,
    replica: &DatabaseConnection,
    lock: &LocalLock,
) -> Session {
    Session::builder(primary.clone())
        .read_from(replica.clone())
        .lock(Arc::new(lock.clone()))
        .build()
        .expect("session")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_from_the_replica_writes_stay_on_the_primary() {
    if servers::url(servers::POSTGRES).is_none() {
        return;
    }
    let primary_server = PrivatePostgres::start();
    let primary = connect(&primary_server.url()).await;
    Migrator::up(&primary, None).await.expect("migrate");
    let rows = (1..=2).map(node::ActiveModel::fresh);
    node::Entity::insert_many(rows)
        .exec(&primary)
        .await
        .expect("seed");
    let replica_server = primary_server.replica();
    let replica = connect(&replica_server.url()).await;
    eventually("the replica has the seeded rows", || async {
        node::Entity::find_by_id(2)
            .one(&replica)
            .await
            .is_ok_and(|row| row.is_some())
    })
    .await;

    // Make the replica stale for certain: pause its replay, then write on the primary.
    replica
        .execute_unprepared("SELECT pg_wal_replay_pause()")
        .await
        .expect("pause replay");
    eventually("replay paused", || async {
        sql_text(&replica, "SELECT pg_get_wal_replay_pause_state()").await == "paused"
    })
    .await;
    let lock = LocalLock::new();
    let other = Session::builder(primary.clone())
        .lock(Arc::new(lock.clone()))
        .build()
        .expect("session");
    other
        .repository::<node::Entity>()
        .locked_update(1, |n| {
            n.score = Set(Some(10));
            Ok(())
        })
        .await
        .expect("the other writer");

    let session = reading(&primary, &replica, &lock);
    let nodes = session.repository::<node::Entity>();
    let stale = nodes.load(1).await.expect("load").expect("row");
    assert_eq!(stale.score, None, "load read the (paused) replica");
    assert_eq!(
        nodes
            .load_fresh(1)
            .await
            .expect("load_fresh")
            .and_then(|n| n.score),
        Some(10),
        "load_fresh reads the primary"
    );

    // A guarded save based on a stale replica read: refused, nothing overwritten.
    nodes.reset_cache([1]).expect("reset");
    let stale = nodes.load(1).await.expect("load").expect("row");
    assert_eq!(stale.score, None);
    let mut draft = (*stale).clone().into_active_model();
    draft.score = Set(Some(1));
    let saved = nodes.save(draft).await.expect("save");
    assert!(matches!(saved, SaveOutcome::Conflict), "{saved:?}");
    assert_eq!(
        score(&primary, 1).await,
        Some(10),
        "the other write is kept"
    );

    // locked_update reloads on the primary: builds on the other write.
    let report = nodes
        .locked_update(1, |n| {
            let s = n.score.as_ref().unwrap_or(0);
            n.score = Set(Some(s + 1));
            Ok(())
        })
        .await
        .expect("locked_update");
    assert_eq!(report.outcome.model().and_then(|n| n.score), Some(11));
    assert_eq!(score(&primary, 1).await, Some(11));

    // Replay on again: 4 tasks × 25 increments, each after a load from the replica.
    replica
        .execute_unprepared("SELECT pg_wal_replay_resume()")
        .await
        .expect("resume replay");
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let session = reading(&primary, &replica, &lock);
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                let mut acknowledged = 0;
                for _ in 0..25 {
                    nodes.reset_cache([2]).expect("reset");
                    nodes.load(2).await.expect("load");
                    let report = nodes
                        .locked_update(2, |n| {
                            let s = n.score.as_ref().unwrap_or(0);
                            n.score = Set(Some(s + 1));
                            Ok(())
                        })
                        .await
                        .expect("locked_update");
                    assert!(report.outcome.is_updated());
                    acknowledged += 1;
                }
                acknowledged
            })
        })
        .collect();
    let mut acknowledged = 0;
    for task in tasks {
        acknowledged += task.await.expect("task");
    }
    assert_eq!(acknowledged, 100);
    assert_eq!(
        score(&primary, 2).await,
        Some(100),
        "every acknowledged increment, once"
    );
    eventually("the replica catches up", || async {
        score(&replica, 2).await == Some(100)
    })
    .await;

    // A replica of another kind of database is refused.
    let sqlite = common::memory_db().await;
    let refused = Session::builder(primary.clone()).read_from(sqlite).build();
    assert!(
        matches!(refused, Err(Error::InvalidReplica { .. })),
        "{refused:?}"
    );
    drop(replica_server);
}
