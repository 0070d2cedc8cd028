//! A section never waits for a second connection of its own pool: with a pool of 2 and 50 tasks
//! (10 per row on 5 rows), every backend completes every call, none stalls (a call that waited
//! for a connection its own section holds would run into the pool's acquire timeout), and every
//! increment is counted once. Throughput is printed for comparison between backends (the
//! numbers belong in the notes and benchmarks, not in an assertion).

#[path = "common/servers.rs"]
mod servers;

use std::time::Duration;

use entity::node;
use freshlock::{LockKind, LockPolicy, OnLockFailure, Session};
use sea_orm::Set;
use servers::{TestDb, databases};

const TASKS: i32 = 50;
const ROWS: i32 = 5;
const CALLS: i32 = 10;

async fn fifty_tasks_on_two_connections(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let redis = servers::url(servers::REDIS);
    if kind == LockKind::Redis && redis.is_none() {
        return;
    }
    db.seed_nodes(ROWS).await;
    let pool = servers::connect(&db.url, db.schema.as_deref(), 2).await;
    let backend = kind
        .connect(&pool, &db.url, redis.as_deref())
        .await
        .unwrap();
    let session = Session::builder(pool.clone())
        .lock(backend)
        .policy(
            LockPolicy::default()
                .with_lock_tries(1)
                .with_wait_per_try(Duration::from_secs(60))
                .with_on_failure(OnLockFailure::Fail),
        )
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let nodes = session.repository::<node::Entity>();
            tokio::spawn(async move {
                let id = task % ROWS + 1;
                for _ in 0..CALLS {
                    let call = nodes.locked_update(id, |n| {
                        let score = n.score.as_ref().unwrap_or(0);
                        n.score = Set(Some(score + 1));
                        Ok(())
                    });
                    let report = tokio::time::timeout(Duration::from_secs(20), call)
                        .await
                        .expect("no call stalls on its own pool")
                        .unwrap();
                    assert!(report.outcome.is_updated() && report.lock.held);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let elapsed = started.elapsed();
    for id in 1..=ROWS {
        assert_eq!(db.score(id).await, Some(TASKS / ROWS * CALLS), "row {id}");
    }
    eprintln!(
        "{kind} on {:?}, pool of 2, 50 tasks: {} calls in {elapsed:?} ({:.0}/s)",
        pool.get_database_backend(),
        TASKS * CALLS,
        f64::from(TASKS * CALLS) / elapsed.as_secs_f64()
    );
}

servers::server_tests! {
    local_postgres: fifty_tasks_on_two_connections, LockKind::Local, postgres;
    table_postgres: fifty_tasks_on_two_connections, LockKind::Table, postgres;
    row_postgres: fifty_tasks_on_two_connections, LockKind::Row, postgres;
    pg_advisory_postgres: fifty_tasks_on_two_connections, LockKind::PgAdvisory, postgres;
    local_mysql: fifty_tasks_on_two_connections, LockKind::Local, mysql;
    table_mysql: fifty_tasks_on_two_connections, LockKind::Table, mysql;
    row_mysql: fifty_tasks_on_two_connections, LockKind::Row, mysql;
    mysql_named_mysql: fifty_tasks_on_two_connections, LockKind::MySqlNamed, mysql;
    table_sqlite: fifty_tasks_on_two_connections, LockKind::Table, sqlite;
    row_sqlite: fifty_tasks_on_two_connections, LockKind::Row, sqlite;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    redis_postgres: fifty_tasks_on_two_connections, LockKind::Redis, postgres;
}

/// 200 updates of keys that do not exist leave no lock rows behind with the `row` backend (its
/// lock row is created in the section's transaction, which rolls back).
async fn missing_keys_leave_no_lock_rows(db: Option<TestDb>, kind: LockKind) {
    use sea_orm::{ConnectionTrait, Statement};
    let Some(db) = db else { return };
    let backend = kind.connect(&db.db, &db.url, None).await.unwrap();
    let session = Session::builder(db.db.clone())
        .lock(backend)
        .build()
        .unwrap();
    let nodes = session.repository::<node::Entity>();
    for id in 1000..1200 {
        let report = nodes.locked_update(id, |_| Ok(())).await.unwrap();
        assert!(matches!(report.outcome, freshlock::UpdateOutcome::NotFound));
    }
    let rows = db
        .db
        .query_one_raw(Statement::from_string(
            db.db.get_database_backend(),
            "SELECT COUNT(*) AS n FROM freshlock_row_lock",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get::<i64>("", "n")
        .unwrap();
    assert_eq!(rows, 0);
}

servers::server_tests! {
    no_rows_for_missing_keys_postgres: missing_keys_leave_no_lock_rows, LockKind::Row, postgres;
    no_rows_for_missing_keys_mysql: missing_keys_leave_no_lock_rows, LockKind::Row, mysql;
}
