//! `get_or_insert` and `update_or_insert` under races: 16 tasks ask for the same missing key —
//! exactly one creates it and all get the same row — on every backend × database, also with no
//! lock at all (then the unique key decides). Four OS processes race in `cross_process.rs`.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::{sync::Arc, time::Duration};

use common::FakeLock;
use entity::node;
use freshlock::{Error, LockBackend, LockKind, LockPolicy, OnLockFailure, Session, UpdateOutcome};
use sea_orm::{EntityTrait, PaginatorTrait, Set};
use servers::{TestDb, databases};
use tokio::sync::Barrier;

const TASKS: usize = 16;

fn sessions(db: &TestDb, backend: &Arc<dyn LockBackend>, locked: bool) -> Vec<Session> {
    let policy = if locked {
        LockPolicy::default()
            .with_lock_tries(1)
            .with_wait_per_try(Duration::from_secs(60))
            .with_on_failure(OnLockFailure::Fail)
    } else {
        LockPolicy::default()
            .with_lock_tries(1)
            .with_wait_per_try(Duration::ZERO)
            .with_on_failure(OnLockFailure::Proceed)
    };
    (0..TASKS)
        .map(|_| {
            Session::builder(db.db.clone())
                .lock(Arc::clone(backend))
                .policy(policy.clone())
                .build()
                .unwrap()
        })
        .collect()
}

/// 16 sessions race `get_or_insert(id)`, each with its own initial title: one creates it, all
/// get the creator's row, the table has one row with that title.
async fn race_get_or_insert(db: &TestDb, sessions: Vec<Session>, id: i32) {
    let start = Arc::new(Barrier::new(sessions.len()));
    let tasks: Vec<_> = sessions
        .into_iter()
        .enumerate()
        .map(|(task, session)| {
            let start = Arc::clone(&start);
            tokio::spawn(async move {
                start.wait().await;
                let nodes = session.repository::<node::Entity>();
                tokio::time::timeout(
                    Duration::from_secs(60),
                    nodes.get_or_insert(id, || node::ActiveModel {
                        title: Set(format!("by task {task}")),
                        ..node::ActiveModel::fresh(id)
                    }),
                )
                .await
                .expect("no call hangs")
                .unwrap()
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    let created = results.iter().filter(|got| got.is_created()).count();
    assert_eq!(created, 1, "exactly one creator");
    let stored = node::Entity::find_by_id(id)
        .one(&db.db)
        .await
        .unwrap()
        .unwrap();
    for got in &results {
        assert_eq!(**got.model(), stored, "everyone gets the winner's row");
    }
}

/// 16 sessions each `update_or_insert(id, score 0, +1)`: the row ends at 16, one call inserted,
/// every acknowledged call is counted once (a call may only fail by reporting a conflict).
async fn race_update_or_insert(db: &TestDb, sessions: Vec<Session>, id: i32) {
    let start = Arc::new(Barrier::new(sessions.len()));
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|session| {
            let start = Arc::clone(&start);
            tokio::spawn(async move {
                start.wait().await;
                let nodes = session.repository::<node::Entity>();
                let call = nodes.update_or_insert(
                    id,
                    || node::ActiveModel {
                        score: Set(Some(0)),
                        ..node::ActiveModel::fresh(id)
                    },
                    |n| {
                        let score = n.score.as_ref().unwrap_or(0);
                        n.score = Set(Some(score + 1));
                        Ok(())
                    },
                );
                tokio::time::timeout(Duration::from_secs(60), call)
                    .await
                    .expect("no call hangs")
            })
        })
        .collect();
    let (mut inserted, mut updated, mut conflicts) = (0, 0, 0);
    for task in tasks {
        match task.await.unwrap() {
            Ok(report) => match report.outcome {
                UpdateOutcome::Inserted(_) => inserted += 1,
                UpdateOutcome::Updated(_) => updated += 1,
                other => panic!("unexpected {other:?}"),
            },
            Err(Error::Conflict { .. }) => conflicts += 1,
            Err(other) => panic!("unexpected error: {other}"),
        }
    }
    assert_eq!(inserted, 1, "exactly one insert");
    assert_eq!(inserted + updated + conflicts, TASKS);
    assert_eq!(
        db.score(id).await,
        Some(inserted as i32 + updated as i32),
        "each acknowledged call applied once"
    );
}

async fn races(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let redis = servers::url(servers::REDIS);
    if kind == LockKind::Redis && redis.is_none() {
        return;
    }
    let backend = kind
        .connect(&db.db, &db.url, redis.as_deref())
        .await
        .unwrap();
    race_get_or_insert(&db, sessions(&db, &backend, true), 7).await;
    race_update_or_insert(&db, sessions(&db, &backend, true), 8).await;
}

/// No lock at all: the unique key alone keeps one creator, and the guard keeps every update.
async fn races_without_a_lock(db: Option<TestDb>, _: LockKind) {
    let Some(db) = db else { return };
    let none: Arc<dyn LockBackend> = Arc::new(FakeLock::without_lock());
    race_get_or_insert(&db, sessions(&db, &none, false), 9).await;
    race_update_or_insert(&db, sessions(&db, &none, false), 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn races_in_memory() {
    let memory = common::memory_db().await;
    let db = TestDb {
        handle: freshlock::Db::new(memory.clone()),
        db: memory,
        url: String::new(),
        schema: None,
    };
    races(Some(db.clone()), LockKind::Local).await;
    races_without_a_lock(Some(db), LockKind::Local).await;
}

#[tokio::test]
async fn an_initial_row_with_another_key_is_refused_and_nothing_is_written() {
    let db = common::memory_db().await;
    let nodes = Session::new(db.clone()).repository::<node::Entity>();
    let result = nodes.get_or_insert(1, || node::ActiveModel::fresh(2)).await;
    assert!(matches!(
        result,
        Err(Error::InvalidKey { entity: "node", .. })
    ));
    let result = nodes
        .update_or_insert(1, || node::ActiveModel::fresh(2), |_| Ok(()))
        .await;
    assert!(matches!(
        result,
        Err(Error::InvalidKey { entity: "node", .. })
    ));
    // apply may not move the new row to another key either.
    let result = nodes
        .update_or_insert(
            1,
            || node::ActiveModel::fresh(1),
            |n| {
                n.id = Set(3);
                Ok(())
            },
        )
        .await;
    assert!(matches!(result, Err(Error::PrimaryKeyChanged { .. })));
    assert_eq!(node::Entity::find().count(&db).await.unwrap(), 0);
    // A key left NotSet is the key asked for.
    let got = nodes
        .get_or_insert(4, || node::ActiveModel {
            id: sea_orm::ActiveValue::NotSet,
            ..node::ActiveModel::fresh(0)
        })
        .await
        .unwrap();
    assert!(
        matches!(&got, freshlock::GetOutcome::Created(row) if row.id == 4),
        "{got:?}"
    );
}

servers::server_tests! {
    local_sqlite: races, LockKind::Local, sqlite;
    table_sqlite: races, LockKind::Table, sqlite;
    row_sqlite: races, LockKind::Row, sqlite;
    none_sqlite: races_without_a_lock, LockKind::Local, sqlite;
    local_postgres: races, LockKind::Local, postgres;
    table_postgres: races, LockKind::Table, postgres;
    row_postgres: races, LockKind::Row, postgres;
    pg_advisory_postgres: races, LockKind::PgAdvisory, postgres;
    none_postgres: races_without_a_lock, LockKind::Local, postgres;
    local_mysql: races, LockKind::Local, mysql;
    table_mysql: races, LockKind::Table, mysql;
    row_mysql: races, LockKind::Row, mysql;
    mysql_named_mysql: races, LockKind::MySqlNamed, mysql;
    none_mysql: races_without_a_lock, LockKind::Local, mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    redis_postgres: races, LockKind::Redis, postgres;
    redis_mysql: races, LockKind::Redis, mysql;
}
