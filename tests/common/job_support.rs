//! What the job tests share: the effect their handlers write, and one test per database.
#![allow(dead_code, unused_macros)]

use freshlock::jobs::{self, Enqueued, NewJob};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement, TransactionTrait};

/// The effect a job of the tests has: node `node`'s score plus one, in the job's transaction.
/// The node scores add up to the effects in the database, to count against the jobs.
pub async fn bump(tx: &freshlock::Tx, node: i32) -> Result<(), sea_orm::DbErr> {
    let backend = tx.get_database_backend();
    let sql = if backend == sea_orm::DbBackend::Postgres {
        "UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = $1"
    } else {
        "UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = ?"
    };
    tx.execute_raw(Statement::from_sql_and_values(backend, sql, [node.into()]))
        .await
        .map(drop)
}

/// The number `sql` reads (in a transaction: behind a transaction pooler every statement is).
pub async fn number(db: &DatabaseConnection, sql: &str) -> i64 {
    let txn = db.begin().await.expect("begin");
    let row = txn
        .query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .expect("query")
        .expect("a row");
    txn.commit().await.expect("commit");
    row.try_get_by_index::<Option<i64>>(0)
        .expect("a number")
        .unwrap_or(0)
}

/// Enqueues `job` in a transaction of its own (behind a transaction pooler every statement
/// runs in one).
pub async fn add(db: &DatabaseConnection, job: NewJob) -> freshlock::Result<Enqueued> {
    let txn = db.begin().await.expect("begin");
    let enqueued = jobs::enqueue(&txn, job).await;
    txn.commit().await.expect("commit");
    enqueued
}

/// `CAST(… AS BIGINT)`, in the dialect of `db`.
pub fn bigint(db: &DatabaseConnection, expr: &str) -> String {
    match db.get_database_backend() {
        sea_orm::DbBackend::MySql => format!("CAST({expr} AS SIGNED)"),
        _ => format!("CAST({expr} AS BIGINT)"),
    }
}

pub async fn total_score(db: &DatabaseConnection) -> i64 {
    number(
        db,
        &format!("SELECT {} FROM node", bigint(db, "SUM(score)")),
    )
    .await
}

pub async fn jobs_in(db: &DatabaseConnection, state: i16) -> i64 {
    let sql = format!("SELECT COUNT(*) FROM freshlock_job WHERE state = {state}");
    number(db, &sql).await
}

/// Retries due at once (no backoff), so a test runs them without waiting.
pub fn at_once(attempts: u32) -> freshlock::jobs::RetryPolicy {
    freshlock::jobs::RetryPolicy::default()
        .with_max_attempts(attempts)
        .with_backoff(std::time::Duration::ZERO, std::time::Duration::ZERO)
}

/// A handler (an `async fn`) that bumps the node its job names.
pub async fn bump_node(
    tx: &freshlock::Tx,
    job: freshlock::jobs::Job<i32>,
) -> Result<(), freshlock::ApplyError> {
    bump(tx, job.payload).await?;
    Ok(())
}

/// A leased kind's finish that bumps the node its work returned.
#[allow(dead_code)]
pub async fn bump_output<P: Send>(
    tx: &freshlock::Tx,
    _job: freshlock::jobs::Job<P>,
    node: &i32,
) -> Result<(), freshlock::ApplyError> {
    bump(tx, *node).await?;
    Ok(())
}

/// One multi-threaded test per line `name: scenario, database;`, running
/// `scenario(databases::database("name").await)`; the scenario skips on `None` (no URL).
/// Invoke it where `databases` is in scope.
macro_rules! on_databases {
    ($($test:ident: $scenario:ident, $db:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            $scenario(databases::$db(stringify!($test)).await).await;
        }
    )*};
}

/// Runs `worker` (`Worker::run`) in a task of its own until the returned sender is used (or
/// dropped): the sender, and the task, which gives how many jobs the worker ran.
pub fn run_in_background(
    worker: freshlock::jobs::Worker,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<u64>,
) {
    let (stop_tx, stop) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        worker
            .run(async move {
                let _ = stop.await;
            })
            .await
            .unwrap()
    });
    (stop_tx, running)
}
