//! `locked_delete` racing `locked_update`s: the deleted row holds exactly the increments that
//! were acknowledged, and no update after the delete brings the row back. Every backend ×
//! database.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use entity::node;
use freshlock::{DeleteOutcome, LockKind, LockPolicy, OnLockFailure, Session, UpdateOutcome};
use sea_orm::{EntityTrait, Set};
use servers::{TestDb, databases};
use tokio::sync::Notify;

const UPDATERS: usize = 6;
/// The delete starts once this many increments were acknowledged.
const DELETE_AFTER: u32 = 30;

async fn delete_races_updates(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let redis = servers::url(servers::REDIS);
    if kind == LockKind::Redis && redis.is_none() {
        return;
    }
    db.seed_nodes(1).await;
    let backend = kind
        .connect(&db.db, &db.url, redis.as_deref())
        .await
        .unwrap();
    let session = || {
        Session::builder(db.db.clone())
            .lock(Arc::clone(&backend))
            .policy(
                LockPolicy::default()
                    .with_lock_tries(1)
                    .with_wait_per_try(Duration::from_secs(60))
                    .with_on_failure(OnLockFailure::Fail),
            )
            .build()
            .unwrap()
    };
    let updated = Arc::new(AtomicU32::new(0));
    let enough = Arc::new(Notify::new());
    let updaters: Vec<_> = (0..UPDATERS)
        .map(|_| {
            let nodes = session().repository::<node::Entity>();
            let (updated, enough) = (Arc::clone(&updated), Arc::clone(&enough));
            tokio::spawn(async move {
                // Until this updater sees the row gone (bounded: the delete comes after 30).
                for _ in 0..10_000 {
                    let report = nodes
                        .locked_update(1, |n| {
                            let score = n.score.as_ref().unwrap_or(0);
                            n.score = Set(Some(score + 1));
                            Ok(())
                        })
                        .await
                        .unwrap();
                    match report.outcome {
                        UpdateOutcome::Updated(_) => {
                            if updated.fetch_add(1, Ordering::SeqCst) + 1 == DELETE_AFTER {
                                enough.notify_one();
                            }
                        }
                        UpdateOutcome::NotFound => return,
                        other => panic!("unexpected {other:?}"),
                    }
                }
                panic!("the row was never deleted");
            })
        })
        .collect();
    let nodes = session().repository::<node::Entity>();
    enough.notified().await;
    let report = nodes.locked_delete(1).await.unwrap();
    let DeleteOutcome::Deleted(gone) = report.outcome else {
        panic!("expected a delete");
    };
    for updater in updaters {
        tokio::time::timeout(Duration::from_secs(120), updater)
            .await
            .expect("no updater hangs")
            .unwrap();
    }
    let acknowledged = updated.load(Ordering::SeqCst);
    assert!(acknowledged >= DELETE_AFTER);
    assert_eq!(
        gone.score,
        Some(acknowledged as i32),
        "{kind}: the deleted row held every acknowledged increment, and none came after it"
    );
    assert!(
        node::Entity::find_by_id(1)
            .one(&db.db)
            .await
            .unwrap()
            .is_none(),
        "{kind}: no update resurrected the row"
    );
    assert!(nodes.load(1).await.unwrap().is_none());
    assert!(matches!(
        nodes.locked_delete(1).await.unwrap().outcome,
        DeleteOutcome::NotFound
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_races_updates_in_memory() {
    let memory = common::memory_db().await;
    let db = TestDb {
        handle: freshlock::Db::new(memory.clone()),
        db: memory,
        url: String::new(),
        schema: None,
    };
    delete_races_updates(Some(db), LockKind::Local).await;
}

servers::server_tests! {
    table_sqlite: delete_races_updates, LockKind::Table, sqlite;
    row_sqlite: delete_races_updates, LockKind::Row, sqlite;
    local_postgres: delete_races_updates, LockKind::Local, postgres;
    table_postgres: delete_races_updates, LockKind::Table, postgres;
    row_postgres: delete_races_updates, LockKind::Row, postgres;
    pg_advisory_postgres: delete_races_updates, LockKind::PgAdvisory, postgres;
    local_mysql: delete_races_updates, LockKind::Local, mysql;
    table_mysql: delete_races_updates, LockKind::Table, mysql;
    row_mysql: delete_races_updates, LockKind::Row, mysql;
    mysql_named_mysql: delete_races_updates, LockKind::MySqlNamed, mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    redis_postgres: delete_races_updates, LockKind::Redis, postgres;
}

#[tokio::test]
async fn a_lost_lease_deletes_nothing() {
    let db = common::memory_db().await;
    common::seed_nodes(&db, 1).await;
    let lock = common::FakeLock::new();
    lock.lose_lease(true);
    let session = Session::builder(db.clone())
        .lock(Arc::new(lock.clone()))
        .build()
        .unwrap();
    let nodes = session.repository::<node::Entity>();
    let report = nodes.locked_delete(1).await.unwrap();
    assert!(matches!(report.outcome, DeleteOutcome::LeaseLost));
    assert!(report.lock.held);
    assert!(
        node::Entity::find_by_id(1)
            .one(&db)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(lock.releases(), 1, "released after the rollback");
}
