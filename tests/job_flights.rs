//! Keyed jobs in few round trips (`SessionBuilder::two_flights`): `BEGIN` and the take as one
//! message, the handler's statements, then the completion and `COMMIT` as one message. Round
//! trips are counted by a proxy between the pool and the server (a client's messages sent
//! without waiting for a reply in between are one), so a flight added to the path fails here;
//! every acknowledged job is counted against the rows. A job asked to stop while it ran must
//! not commit its handler's writes, though the `COMMIT` rides with its completion.
//!
//! Lost `COMMIT` replies and connections cut after the take are `job_faults.rs`'s storms with
//! two flights.

#[macro_use]
#[path = "common/job_support.rs"]
mod job_support;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/servers.rs"]
mod servers;

use std::sync::Arc;

use freshlock::{
    Session,
    jobs::{self, Cancel, Job, JobOutcome, Jobs, NewJob, RetryPolicy, Worker},
};
use job_support::{bump, bump_node, total_score};
use proxy::{CutAfter, Proxy};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use servers::{TestDb, databases};
use tokio::sync::Notify;

/// A pool of one connection through `proxy`, without the checkout ping (every message the proxy
/// sees is a job's).
async fn proxied(db: &TestDb, proxy: &Proxy) -> DatabaseConnection {
    proxy::one_connection(proxy, &db.url, db.schema.as_deref(), |options| {
        #[cfg(feature = "mysql")]
        if db.db.get_database_backend() == sea_orm::DbBackend::MySql {
            freshlock::db::mysql_read_committed(options);
        }
        #[cfg(not(feature = "mysql"))]
        let _ = options;
    })
    .await
}

fn session(pool: impl Into<freshlock::Db>, two_flights: bool) -> Session {
    Session::builder(pool)
        .two_flights(two_flights)
        .build()
        .expect("session")
}

/// Five nodes, and a pool of one connection through a proxy that counts its round trips:
/// straight to the server (a pooler adds exchanges of its own: CI's pooler tier skips these
/// tests by name rather than count them as passed).
async fn counted(db: &TestDb) -> (Proxy, DatabaseConnection) {
    assert!(
        servers::pooler().is_none(),
        "round trips are counted without a transaction pooler: skip this test behind one"
    );
    db.seed_nodes(5).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(db, &proxy).await;
    (proxy, pool)
}

/// Enqueues `n` jobs of kind `bump` (node `i % 5 + 1`, keyed by `key(i)` when it gives one) and
/// runs them with `worker` until all ran: the round trips that took, and how many completed.
async fn run_counted(
    db: &TestDb,
    proxy: &Proxy,
    worker: &Worker,
    n: i32,
    key: impl Fn(i32) -> Option<String>,
) -> (u32, usize) {
    for i in 0..n {
        let job = NewJob::new("bump", &(i % 5 + 1)).unwrap();
        let job = match key(i) {
            Some(key) => job.key(key),
            None => job,
        };
        jobs::enqueue(&db.db, job).await.unwrap();
    }
    let before = proxy.round_trips();
    let mut completed = 0;
    while completed < n as usize {
        let runs = worker.run_batch().await.unwrap();
        assert!(!runs.is_empty(), "{completed} of {n} ran");
        for run in &runs {
            assert_eq!(run.outcome, JobOutcome::Completed, "{run:?}");
        }
        completed += runs.len();
    }
    (proxy.round_trips() - before, completed)
}

/// A job whose handler sends one UPDATE: three round trips with two flights (`BEGIN` + the
/// take, the UPDATE, the completion + `COMMIT`) where the engine sends five; a batch of eight
/// is two plus its handlers'. A keyed job's completion readies its key's next job in the same
/// statement on PostgreSQL; on MariaDB that promotion is a statement of its own (four). After
/// the first jobs no transaction reads, or asks for, which statements its connection prepared
/// (PostgreSQL).
/// Each acknowledged job's effect is in the database once.
async fn round_trips(db: Option<TestDb>, keyed_extra: u32) {
    let Some(db) = db else { return };
    let (proxy, pool) = counted(&db).await;
    let handlers = Jobs::new().handle("bump", RetryPolicy::default(), bump_node);
    let mut acknowledged = 0;
    for (two_flights, batch, keyed, per_job, per_batch) in [
        (true, 1, false, 3, 0),
        (true, 1, true, 3 + keyed_extra, 0),
        (true, 8, false, 1, 2),
        (false, 1, false, 5, 0),
    ] {
        let worker = Worker::new(session(pool.clone(), two_flights), handlers.clone());
        let worker = worker.with_batch(batch);
        let key = |i: i32| keyed.then(|| format!("k{i}"));
        // The first time prepares the statements, the second reads which the connection has.
        for _ in 0..2 {
            acknowledged += run_counted(&db, &proxy, &worker, 8, key).await.1;
        }
        let (listed, asked) = (proxy.names_listed(), proxy.names_asked());
        let (sent, ran) = run_counted(&db, &proxy, &worker, 16, key).await;
        acknowledged += ran;
        // Which statements the connection prepared is known after the first jobs: not read
        // again, nor asked for (`db/prepared/`).
        assert_eq!(
            (proxy.names_listed(), proxy.names_asked()),
            (listed, asked),
            "two flights {two_flights}, batch {batch}, keyed {keyed}: prepared statements read again"
        );
        let batches = 16 / batch;
        assert_eq!(
            sent,
            16 * per_job + batches * per_batch,
            "two flights {two_flights}, batch {batch}, keyed {keyed}: round trips of 16 jobs"
        );
    }
    assert_eq!(total_score(&db.db).await, acknowledged as i64);
    // On PostgreSQL the take, the completion and its check run as `EXECUTE` of statements
    // prepared on the connection (planned once, not on every message): the pool's one
    // connection has them.
    if db.db.get_database_backend() == sea_orm::DbBackend::Postgres {
        let prepared = job_support::number(
            &pool,
            "SELECT COUNT(*) FROM pg_prepared_statements WHERE name LIKE 'freshlock\\_%'",
        )
        .await;
        assert!(prepared >= 3, "{prepared} statements prepared by name");
    }
}

servers::server_tests! {
    round_trips_postgres: round_trips, 0, postgres;
    round_trips_mysql: round_trips, 1, mysql;
}

/// Enqueues `n` unkeyed jobs of kind `bump` (node `i % 5 + 1`) and runs them with `worker`'s
/// loop (`run_until_idle`, which takes again at once as `Worker::run` does): the round trips
/// that took, and how many completed.
async fn run_looped(db: &TestDb, proxy: &Proxy, worker: &Worker, n: i32) -> (u32, usize) {
    for i in 0..n {
        let job = NewJob::new("bump", &(i % 5 + 1)).unwrap();
        jobs::enqueue(&db.db, job).await.unwrap();
    }
    let before = proxy.round_trips();
    let runs = worker.run_until_idle().await.unwrap();
    for run in &runs {
        assert_eq!(run.outcome, JobOutcome::Completed, "{run:?}");
    }
    assert_eq!(runs.len(), n as usize, "every job ran once");
    (proxy.round_trips() - before, runs.len())
}

/// A worker's loop takes again at once after jobs ran: the next take rides in the last message,
/// after the `COMMIT` (`jobs/flights/pretake.rs`), so a job whose handler sends one UPDATE is
/// two round trips (the UPDATE; the completion, `COMMIT` and the next take) after the loop's
/// first take; one job at a time or eight. `per_loop`: what a loop adds — its first take, the
/// take that finds nothing (with the `ROLLBACK` of its transaction, begun ahead), and the
/// loop's last take (`BEGIN` and the take, `ROLLBACK`).
/// Each acknowledged job's effect is in the database once.
async fn a_loop_sends_the_next_take_ahead(db: Option<TestDb>, (per_job, per_loop): (u32, u32)) {
    let Some(db) = db else { return };
    let (proxy, pool) = counted(&db).await;
    let handlers = Jobs::new().handle("bump", RetryPolicy::default(), bump_node);
    let mut acknowledged = 0;
    for batch in [1, 8] {
        let worker = Worker::new(session(pool.clone(), true), handlers.clone()).with_batch(batch);
        // The first time prepares the statements (PostgreSQL).
        acknowledged += run_looped(&db, &proxy, &worker, 8).await.1;
        let (sent, ran) = run_looped(&db, &proxy, &worker, 16).await;
        acknowledged += ran;
        let attempts = 16 / batch;
        assert_eq!(
            sent,
            attempts * (per_job + batch - 1) + per_loop,
            "batch {batch}: round trips of 16 jobs in a loop"
        );
    }
    assert_eq!(total_score(&db.db).await, acknowledged as i64);
}

// Named `…round_trips_…`: CI's pooler tier skips round trips counted straight to the server.
servers::server_tests! {
    loop_round_trips_postgres: a_loop_sends_the_next_take_ahead, (2, 4), postgres;
    loop_round_trips_mysql: a_loop_sends_the_next_take_ahead, (2, 4), mysql;
}

/// A transaction begun ahead is resolved by the evidence its own message read. On PostgreSQL
/// that message reads the transaction's id, and the server incarnation's token too when the
/// pool has not seen it within a second (`Pool::incarnation`): a loop whose step outlives that
/// second — the second job's handler waits past it — begins its third job's transaction with
/// what the pool knew when the message was written, and its attempt reads that, not what the
/// pool knows once it starts. Every attempt runs once: two round trips a job, as in a loop
/// that stays within the second.
async fn a_loop_outliving_the_incarnation_token(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    let (proxy, pool) = counted(&db).await;
    let (handlers, started, go) = bump_held_at(2);
    let worker = Worker::new(session(pool.clone(), true), handlers);
    // Two jobs first: the first starts the server's incarnation (the table is new), the second
    // reads its token, and the loop below begins with it known.
    for node in 4..=5 {
        jobs::enqueue(&db.db, NewJob::new("bump", &node).unwrap())
            .await
            .unwrap();
    }
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 2);
    for node in 1..=3 {
        jobs::enqueue(&db.db, NewJob::new("bump", &node).unwrap())
            .await
            .unwrap();
    }
    let before = proxy.round_trips();
    let running = tokio::spawn(async move { worker.run_until_idle().await });
    started.notified().await;
    // The pool's sight of the token is a `std::time::Instant`: real time has to pass.
    tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    go.notify_one();
    let runs = running.await.unwrap().unwrap();
    for run in &runs {
        assert_eq!(run.outcome, JobOutcome::Completed, "{run:?}");
    }
    assert_eq!(runs.len(), 3, "every job ran once");
    assert_eq!(
        proxy.round_trips() - before,
        3 * 2 + 4,
        "no attempt failed and ran again"
    );
    assert_eq!(total_score(&db.db).await, 5);
}

// Named `…round_trips_…`: CI's pooler tier skips round trips counted straight to the server.
servers::server_tests! {
    stale_incarnation_round_trips_postgres: a_loop_outliving_the_incarnation_token, (), postgres;
}

/// A take sent after the `COMMIT` that fails there (the proxy spoils its text) leaves the
/// commit made: the jobs before it are acknowledged once, the connection — in a transaction
/// that failed — is closed, and the loop goes on with a take of its own. Every job completes
/// once, its effect in the database once. On PostgreSQL the take goes by a name the proxy
/// spoils: the server's "no such prepared statement" after a `COMMIT` must not have the message
/// sent again (as it is before one): its jobs committed, and are reported so.
async fn a_failed_take_after_the_commit(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    let (proxy, pool) = counted(&db).await;
    let handlers = Jobs::new().handle("bump", RetryPolicy::default(), bump_node);
    proxy.spoil_after_commit(true);
    let worker = Worker::new(session(pool.clone(), true), handlers);
    let (_, ran) = run_looped(&db, &proxy, &worker, 8).await;
    assert!(proxy.spoiled() >= 4, "{} takes spoiled", proxy.spoiled());
    let done = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    assert_eq!(job_support::number(&db.db, done).await, ran as i64);
    assert_eq!(total_score(&db.db).await, ran as i64);
}

servers::server_tests! {
    a_failed_take_after_the_commit_postgres: a_failed_take_after_the_commit, (), postgres;
    a_failed_take_after_the_commit_mysql: a_failed_take_after_the_commit, (), mysql;
}

/// A worker's loop told to stop while a job runs finishes that job and runs no other, though
/// with two flights its last message took the next job ahead (`jobs/flights/pretake.rs`):
/// that transaction is rolled back, so every job left is free to take at once on another
/// connection (`SKIP LOCKED` would pass over a locked one), and each acknowledged job's effect
/// is in the database once.
async fn a_stopped_loop_runs_no_other_job(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    db.seed_nodes(10).await;
    for node in 1..=10 {
        job_support::add(&db.db, NewJob::new("bump", &node).unwrap())
            .await
            .unwrap();
    }
    // The third job waits until the worker was told to stop.
    let (handlers, started, go) = bump_held_at(3);
    let worker = Worker::new(session(&db.handle, true), handlers);
    let (stop, running) = job_support::run_in_background(worker);
    started.notified().await;
    // Sent before the job may end: the loop, which polls it while its step runs, sees it
    // before the job's last message answers.
    stop.send(()).unwrap();
    go.notify_one();
    let ran = running.await.unwrap();
    assert_eq!(ran, 3, "the running job finished, no other ran");
    let done = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    assert_eq!(job_support::number(&db.db, done).await, 3);
    assert_eq!(total_score(&db.db).await, 3);
    let backend = db.db.get_database_backend();
    let txn = sea_orm::TransactionTrait::begin(&db.db).await.unwrap();
    let takeable = txn
        .query_all_raw(Statement::from_string(
            backend,
            "SELECT id FROM freshlock_job WHERE state <> 2 FOR UPDATE SKIP LOCKED",
        ))
        .await
        .unwrap();
    txn.rollback().await.unwrap();
    assert_eq!(takeable.len(), 7, "every job left is free to take");
}

servers::server_tests! {
    a_stopped_loop_runs_no_other_job_postgres: a_stopped_loop_runs_no_other_job, (), postgres;
    a_stopped_loop_runs_no_other_job_mysql: a_stopped_loop_runs_no_other_job, (), mysql;
}

/// The statements freshlock prepared on a connection dropped behind its back (`DEALLOCATE`),
/// three times: freshlock knows which the connection had without reading them on every
/// transaction, so the next job's first statement finds its own gone, goes again with its
/// `PREPARE`, and the names are read again with it (`db/prepared/`). Every job completes, no
/// attempt fails on a statement freshlock thought prepared, and each write is in the table
/// once (PostgreSQL: statements go by name only there).
#[tokio::test]
async fn statements_dropped_behind_freshlocks_back_are_prepared_again() {
    let Some(db) = servers::postgres("job_flights_deallocated").await else {
        return;
    };
    let (proxy, pool) = counted(&db).await;
    let handlers = Jobs::new().handle("bump", RetryPolicy::default(), bump_node);
    let worker = Worker::new(session(pool.clone(), true), handlers);
    let names = "SELECT name FROM pg_prepared_statements WHERE name LIKE 'freshlock\\_%'";
    let mut acknowledged = 0;
    for round in 0..4 {
        let (sent, ran) = run_counted(&db, &proxy, &worker, 4, |_| None).await;
        acknowledged += ran;
        if round > 0 {
            // Three a job, and the first take once more with its `PREPARE`: no attempt failed
            // on a statement it thought prepared.
            assert_eq!(sent, 4 * 3 + 1, "round trips after DEALLOCATE {round}");
        }
        if round == 3 {
            break;
        }
        // On the pool's one connection, the one the jobs ran on.
        let prepared = pool
            .query_all_raw(Statement::from_string(DbBackend::Postgres, names))
            .await
            .expect("the names");
        assert!(
            prepared.len() >= 3,
            "{} statements prepared",
            prepared.len()
        );
        for row in prepared {
            let name: String = row.try_get("", "name").expect("a name");
            pool.execute_unprepared(&format!("DEALLOCATE {name}"))
                .await
                .expect("deallocate");
        }
    }
    assert_eq!(total_score(&db.db).await, acknowledged as i64);
    assert_eq!(acknowledged, 16);
}

/// Runs `counted` with a worker of `handlers` on `pool`, with two flights, then on the engine,
/// each given its round trips per job (`per_job`'s first, then its second): how many jobs it
/// acknowledged in all.
async fn both_paths(
    pool: &DatabaseConnection,
    handlers: &Jobs,
    per_job: (u32, u32),
    counted: impl AsyncFn(&Worker, bool, u32) -> usize,
) -> usize {
    let mut acknowledged = 0;
    for (two_flights, per_job) in [(true, per_job.0), (false, per_job.1)] {
        let worker = Worker::new(session(pool.clone(), two_flights), handlers.clone());
        acknowledged += counted(&worker, two_flights, per_job).await;
    }
    acknowledged
}

/// Kind `bump` leased: its work returns the node, its finish bumps it.
fn leased_bump() -> Jobs {
    Jobs::new().handle_leased(
        "bump",
        RetryPolicy::default(),
        std::time::Duration::from_secs(30),
        async |job: Job<i32>, _lease: jobs::Lease| Ok(job.payload),
        job_support::bump_output,
    )
}

/// Kind `bump` leased, its finish sending nothing (the completion is its transaction's only
/// statement).
fn leased_quiet() -> Jobs {
    Jobs::new().handle_leased(
        "bump",
        RetryPolicy::default(),
        std::time::Duration::from_secs(30),
        async |job: Job<i32>, _lease: jobs::Lease| Ok(job.payload),
        async |_tx: &freshlock::Tx, _job: Job<i32>, _node: &i32| Ok(()),
    )
}

/// A leased job whose finish sends one UPDATE: five round trips with two flights where the
/// engine sends nine — the claim (`BEGIN` + the take, then the claim's UPDATE + `COMMIT`, the
/// evidence read with `BEGIN` or a marker riding in that message) and the finish (`BEGIN`, the
/// finish's UPDATE, the completion + its check + `COMMIT`) — and each acknowledged finish's
/// write in the database once.
async fn leased_round_trips(db: Option<TestDb>, (quiet, per_job): (bool, (u32, u32))) {
    let Some(db) = db else { return };
    let (proxy, pool) = counted(&db).await;
    let handlers = match quiet {
        false => leased_bump(),
        true => leased_quiet(),
    };
    let counted = async |worker: &Worker, two_flights: bool, per_job: u32| {
        let warm = run_counted(&db, &proxy, worker, 8, |_| None).await.1;
        let (sent, ran) = run_counted(&db, &proxy, worker, 16, |_| None).await;
        assert_eq!(
            sent,
            16 * per_job,
            "two flights {two_flights}, a finish that sends nothing {quiet}: round trips of 16 \
             leased jobs"
        );
        warm + ran
    };
    let acknowledged = both_paths(&pool, &handlers, per_job, counted).await;
    let done = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    assert_eq!(job_support::number(&db.db, done).await, acknowledged as i64);
    if !quiet {
        assert_eq!(total_score(&db.db).await, acknowledged as i64);
    }
}

servers::server_tests! {
    leased_round_trips_postgres: leased_round_trips, (false, (5, 9)), postgres;
    leased_round_trips_mysql: leased_round_trips, (false, (5, 9)), mysql;
}

// A leased job whose finish sends nothing: with two flights its finish is one message
// (`BEGIN`, the commit marker, the completion, its check, `COMMIT`; on PostgreSQL the marker
// instead of the transaction's id, which would need a message before, and the completion by the
// name the connection prepared it under, without reading the names first: `db/prepared/`);
// with its claim's two, three round trips. The engine sends eight. Every acknowledged job is
// done once (`leased_round_trips`).
servers::server_tests! {
    quiet_finish_round_trips_postgres: leased_round_trips, (true, (3, 8)), postgres;
    quiet_finish_round_trips_mysql: leased_round_trips, (true, (3, 8)), mysql;
}

/// Kind `bump` (its payload the node it bumps), whose job bumping node `held` says so on the
/// first `Notify` once it wrote, then waits for the second before it returns.
fn bump_held_at(held: i32) -> (Jobs, Arc<Notify>, Arc<Notify>) {
    let started = Arc::new(Notify::new());
    let go = Arc::new(Notify::new());
    let (s, g) = (Arc::clone(&started), Arc::clone(&go));
    let handlers = Jobs::new().handle(
        "bump",
        RetryPolicy::default(),
        jobs::handler(move |tx, job: Job<i32>| {
            let (started, go) = (Arc::clone(&s), Arc::clone(&g));
            Box::pin(async move {
                bump(tx, job.payload).await?;
                if job.payload == held {
                    started.notify_one();
                    go.notified().await;
                }
                Ok(())
            })
        }),
    );
    (handlers, started, go)
}

/// A job asked to stop while its handler runs: its completion finds the request, the check
/// after it stops the message before its `COMMIT`, and the handler's write is rolled back — the
/// job ends cancelled, not run again; the job beside it in the batch runs again and completes
/// once.
async fn cancel_while_running(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    db.seed_nodes(2).await;
    let (handlers, started, go) = bump_held_at(1);
    let stopped = job_support::add(&db.db, NewJob::new("bump", &1).unwrap())
        .await
        .unwrap();
    let jobs::Enqueued::Added(stopped) = stopped else {
        panic!("added")
    };
    job_support::add(&db.db, NewJob::new("bump", &2).unwrap())
        .await
        .unwrap();
    let worker = Worker::new(session(&db.handle, true), handlers).with_batch(2);
    let running = tokio::spawn(async move { worker.run_until_idle().await });
    started.notified().await;
    assert_eq!(
        jobs::cancel(&db.handle, stopped).await.unwrap(),
        Cancel::Requested
    );
    go.notify_one();
    let runs = running.await.unwrap().unwrap();
    let outcome = |id| runs.iter().find(|r| r.id == id).map(|r| r.outcome.clone());
    assert_eq!(outcome(stopped), Some(JobOutcome::Cancelled), "{runs:?}");
    assert_eq!(
        db.score(1).await,
        None,
        "the cancelled job's write rolled back"
    );
    assert_eq!(db.score(2).await, Some(1), "the other job's write, once");
}

servers::server_tests! {
    cancel_while_running_postgres: cancel_while_running, (), postgres;
    cancel_while_running_mysql: cancel_while_running, (), mysql;
}

/// A handler that fails in a batch: the attempt rolls back and runs again with a savepoint per
/// job (sent by freshlock on the held connection), the failing job records its failure, the
/// others complete once.
async fn failing_handler_in_a_batch(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    db.seed_nodes(4).await;
    let handlers = Jobs::new().handle(
        "bump",
        job_support::at_once(1),
        async |tx: &freshlock::Tx, job: Job<i32>| {
            bump(tx, job.payload).await?;
            if job.payload == 3 {
                return Err(freshlock::ApplyError::msg("node 3 refuses"));
            }
            Ok(())
        },
    );
    for node in 1..=4 {
        job_support::add(&db.db, NewJob::new("bump", &node).unwrap())
            .await
            .unwrap();
    }
    let worker = Worker::new(session(&db.handle, true), handlers).with_batch(4);
    let runs = worker.run_until_idle().await.unwrap();
    assert_eq!(runs.len(), 4, "{runs:?}");
    for node in [1, 2, 4] {
        assert_eq!(db.score(node).await, Some(1), "node {node} once");
    }
    assert_eq!(
        db.score(3).await,
        None,
        "the failed job's write rolled back"
    );
    let failed = runs
        .iter()
        .filter(|r| matches!(r.outcome, JobOutcome::Failed(_)));
    assert_eq!(failed.count(), 1, "{runs:?}");
}

servers::server_tests! {
    failing_handler_in_a_batch_postgres: failing_handler_in_a_batch, (), postgres;
    failing_handler_in_a_batch_mysql: failing_handler_in_a_batch, (), mysql;
}

/// A hot key's leased jobs, each finish claiming the key's next job (`Worker::run_until_idle`
/// follows the chain): with two flights a job costs two round trips — `BEGIN` with the finish's
/// UPDATE, then the completion, the promotion that claims the next job, the claimed job's read
/// and `COMMIT` as one message — on PostgreSQL and MySQL/MariaDB alike; the engine sends four
/// on PostgreSQL (the promotion rides in the completion) and five on MySQL/MariaDB (the
/// completion and the promotion in one message, the claimed job's read after it). Counted as
/// the difference between chains of 16 and 8 jobs (the first claim and the last look for work
/// cost the same in both); each acknowledged finish's write in the database once.
async fn chain_round_trips(db: Option<TestDb>, per_job: (u32, u32)) {
    let Some(db) = db else { return };
    let (proxy, pool) = counted(&db).await;
    let counted = async |worker: &Worker, two_flights: bool, per_job: u32| {
        let (mut sent, mut acknowledged) = (Vec::new(), 0);
        for n in [8, 8, 8, 16] {
            for i in 0..n {
                let job = NewJob::new("bump", &(i % 5 + 1)).unwrap().key("hot");
                jobs::enqueue(&db.db, job).await.unwrap();
            }
            let before = proxy.round_trips();
            let runs = worker.run_until_idle().await.unwrap();
            assert_eq!(runs.len(), n as usize, "{runs:?}");
            for run in &runs {
                assert_eq!(run.outcome, JobOutcome::Completed, "{run:?}");
            }
            acknowledged += runs.len();
            sent.push(proxy.round_trips() - before);
        }
        // The first chains prepare the statements (the last look for work's too).
        assert_eq!(
            sent[3] - sent[2],
            8 * per_job,
            "two flights {two_flights}: round trips of a chain of 16 against one of 8 ({sent:?})"
        );
        acknowledged
    };
    let acknowledged = both_paths(&pool, &leased_bump(), per_job, counted).await;
    assert_eq!(total_score(&db.db).await, acknowledged as i64);
}

servers::server_tests! {
    chain_round_trips_postgres: chain_round_trips, (3, 4), postgres;
    chain_round_trips_mysql: chain_round_trips, (3, 5), mysql;
}

/// Without `freshlock_incarnation` a PostgreSQL transaction's evidence is a marker whose INSERT
/// rides in its last message: a leased finish that sends nothing is one message, its statements
/// by name, as with the table — three round trips a job (its finish once sent `PREPARE` for
/// statements the connection had, 42P05, and failed every time after the first jobs). Every
/// acknowledged job is done once.
async fn quiet_finish_with_markers(db: Option<TestDb>, per_job: u32) {
    let Some(db) = db else { return };
    let drop = "DROP TABLE freshlock_incarnation";
    db.db.execute_unprepared(drop).await.unwrap();
    let (proxy, pool) = counted(&db).await;
    let handlers = leased_quiet();
    let worker = Worker::new(session(pool, true), handlers);
    let warm = run_counted(&db, &proxy, &worker, 8, |_| None).await.1;
    let (sent, ran) = run_counted(&db, &proxy, &worker, 16, |_| None).await;
    assert_eq!(sent, 16 * per_job, "round trips of 16 leased jobs");
    let done = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    assert_eq!(job_support::number(&db.db, done).await, (warm + ran) as i64);
    let markers = "SELECT COUNT(*) FROM freshlock_commit";
    assert!(job_support::number(&db.db, markers).await > 0, "markers");
}

servers::server_tests! {
    quiet_finish_with_markers_round_trips_postgres: quiet_finish_with_markers, 3, postgres;
}

/// Leased finishes that send nothing, with two flights, not counted: so they run behind a
/// transaction pooler too (CI's pooler tier), where the one message goes as text with its
/// marker. Every job completes once.
async fn quiet_finishes(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    let worker = Worker::new(session(&db.handle, true), leased_quiet());
    for i in 0..16 {
        let job = NewJob::new("bump", &(i % 5 + 1))
            .unwrap()
            .key(format!("k{}", i % 3));
        job_support::add(&db.db, job).await.unwrap();
    }
    let runs = worker.run_until_idle().await.unwrap();
    assert_eq!(runs.len(), 16, "{runs:?}");
    assert!(
        runs.iter().all(|run| run.outcome == JobOutcome::Completed),
        "{runs:?}"
    );
    let done = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    assert_eq!(job_support::number(&db.db, done).await, 16);
}

servers::server_tests! {
    quiet_finishes_postgres: quiet_finishes, (), postgres;
    quiet_finishes_mysql: quiet_finishes, (), mysql;
}

/// A leased finish that sends nothing goes by the names of statements it assumes the
/// connection prepared (it reads no names: one message). After `DEALLOCATE ALL` behind
/// freshlock's back it stops at the first one before its `COMMIT` (SQLSTATE 26000), rolls back,
/// reads the names and goes again with the `PREPARE`s it lacks: the job completes once, two
/// round trips later, and the next finish is one message again.
#[tokio::test]
async fn a_quiet_finish_prepares_what_the_connection_lost() {
    let Some(db) = servers::postgres("job_flights_quiet_deallocated").await else {
        return;
    };
    let (proxy, pool) = counted(&db).await;
    let handlers = leased_quiet();
    let worker = Worker::new(session(pool.clone(), true), handlers);
    let mut acknowledged = run_counted(&db, &proxy, &worker, 8, |_| None).await.1;
    for round in 0..3 {
        pool.execute_unprepared("DEALLOCATE ALL")
            .await
            .expect("deallocate");
        let (sent, ran) = run_counted(&db, &proxy, &worker, 4, |_| None).await;
        acknowledged += ran;
        // Three a job; the first claim's take once more with its `PREPARE`, and the first
        // finish's two (`ROLLBACK` with the names, then its message again after its
        // `PREPARE`s).
        assert_eq!(
            sent,
            4 * 3 + 3,
            "round trips after DEALLOCATE ALL, round {round}"
        );
        let (sent, ran) = run_counted(&db, &proxy, &worker, 4, |_| None).await;
        acknowledged += ran;
        assert_eq!(
            sent,
            4 * 3,
            "round trips once prepared again, round {round}"
        );
    }
    let done = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    assert_eq!(job_support::number(&db.db, done).await, acknowledged as i64);
    assert_eq!(acknowledged, 8 + 3 * 8);
}
