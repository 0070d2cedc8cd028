//! Keyed jobs through a TCP proxy that cuts connections: a lost `COMMIT` reply (the server
//! committed the job and its write, the worker never heard) is resolved from the commit's
//! evidence, never run twice; a connection cut right after a job was taken rolls the take back
//! and the job runs on another connection. Every acknowledged completion is a done job, and
//! every done job's effect is in the database exactly once. PostgreSQL and MariaDB (only this
//! test's own connections are cut).

#[macro_use]
#[path = "common/job_support.rs"]
mod job_support;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use freshlock::{
    Error, LockPolicy, Session,
    jobs::{self, Job, JobOutcome, Jobs, NewJob, RetryPolicy, Worker},
};
use job_support::{bump_node, bump_output};
use proxy::{CutAfter, Proxy};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use servers::{TestDb, databases};
use tokio::sync::Barrier;

const JOBS: i32 = 120;
const WORKERS: usize = 4;

/// A pool through `proxy` to the test's database, without a statement cache when `uncached`
/// (so that every statement's text crosses the proxy and the take can be recognized).
async fn through(proxy: &Proxy, db: &TestDb, uncached: bool) -> DatabaseConnection {
    let options = options_through(proxy, db, uncached);
    sea_orm::Database::connect(options).await.expect("connect")
}

/// [`through`]'s pool options.
fn options_through(proxy: &Proxy, db: &TestDb, uncached: bool) -> sea_orm::ConnectOptions {
    let mut options = sea_orm::ConnectOptions::new(proxy.url(&db.url));
    options
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    if let Some(schema) = &db.schema {
        options
            .set_schema_search_path(schema)
            .set_application_name(schema);
    }
    if uncached {
        #[cfg(feature = "postgres")]
        options.map_sqlx_postgres_opts(|o| o.statement_cache_capacity(0));
        #[cfg(feature = "mysql")]
        options.map_sqlx_mysql_opts(|o| o.statement_cache_capacity(0));
    }
    options
}

async fn number(db: &DatabaseConnection, sql: &str) -> i64 {
    let row = db
        .query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<Option<i64>>(0).unwrap().unwrap_or(0)
}

/// `two_flights`: the session's jobs in few round trips (`SessionBuilder::two_flights`: the take
/// in `BEGIN`'s message, the completion in `COMMIT`'s).
async fn jobs_through_cuts(
    db: Option<TestDb>,
    cut: CutAfter,
    every: u32,
    leased: bool,
    two_flights: bool,
) {
    let Some(db) = db else { return };
    db.seed_nodes(5).await;
    for seq in 0..JOBS {
        let node = seq % 5 + 1;
        let job = NewJob::new("bump", &node).unwrap();
        let job = if node < 5 {
            job.key(format!("node:{node}"))
        } else {
            job
        };
        jobs::enqueue(&db.db, job).await.unwrap();
    }
    let proxy = Proxy::start(proxy::target(&db.url), cut).await;
    let proxied = through(&proxy, &db, cut == CutAfter::Reload).await;
    proxy.cut_every(every);
    let handlers = if leased {
        // Claimed under a 1 s lease (its commit cut too), worked outside, finished fenced.
        let work =
            |job: Job<i32>, _lease| async move { Ok::<_, freshlock::ApplyError>(job.payload) };
        let lease = Duration::from_secs(1);
        Jobs::new().handle_leased("bump", RetryPolicy::default(), lease, work, bump_output)
    } else {
        Jobs::new().handle("bump", RetryPolicy::default(), bump_node)
    };
    let session = Session::builder(proxied)
        .two_flights(two_flights)
        .build()
        .unwrap();
    let acknowledged = Arc::new(AtomicU32::new(0));
    let unknown = Arc::new(AtomicU32::new(0));
    let start = Arc::new(Barrier::new(WORKERS));
    let done_sql = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            // Half the workers commit batches of up to 8 jobs (their evidence taken by the
            // batch's completion statement on PostgreSQL).
            let batch = if w % 2 == 0 { 1 } else { 8 };
            let worker = Worker::new(session.clone(), handlers.clone()).with_batch(batch);
            let (acknowledged, unknown, start) = (
                Arc::clone(&acknowledged),
                Arc::clone(&unknown),
                Arc::clone(&start),
            );
            let direct = db.db.clone();
            tokio::spawn(async move {
                start.wait().await;
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                loop {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "the jobs did not finish"
                    );
                    match worker.run_batch().await {
                        Ok(runs) if !runs.is_empty() => {
                            for run in runs {
                                // A claim whose lease expired while its reply was lost is
                                // refused at its finish: not acknowledged, run again.
                                if run.outcome == JobOutcome::LeaseLost {
                                    continue;
                                }
                                assert_eq!(run.outcome, JobOutcome::Completed, "{run:?}");
                                acknowledged.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        Ok(_) => {
                            if number(&direct, done_sql).await == i64::from(JOBS) {
                                return;
                            }
                            tokio::task::yield_now().await;
                        }
                        Err(Error::CommitUnknown { .. }) => {
                            unknown.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(e) if e.is_transient() => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    let sum = if db.db.get_database_backend() == sea_orm::DbBackend::MySql {
        "SELECT CAST(SUM(score) AS SIGNED) FROM node"
    } else {
        "SELECT CAST(SUM(score) AS BIGINT) FROM node"
    };
    let (acknowledged, unknown) = (
        acknowledged.load(Ordering::SeqCst),
        unknown.load(Ordering::SeqCst),
    );
    eprintln!(
        "{cut:?} (leased: {leased}, two flights: {two_flights}): {} cut; {acknowledged} acknowledged, {unknown} unknown",
        proxy.cuts()
    );
    assert!(proxy.cuts() >= 5, "the proxy cut connections");
    assert_eq!(unknown, 0, "every lost reply was resolved");
    assert_eq!(number(&db.db, done_sql).await, i64::from(JOBS));
    assert_eq!(
        acknowledged, JOBS as u32,
        "each job acknowledged exactly once"
    );
    assert_eq!(
        number(&db.db, sum).await,
        i64::from(JOBS),
        "every job's effect is in the database exactly once"
    );
}

async fn lost_commit_replies(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Commit, 4, false, false).await;
}

async fn cut_after_the_take(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Reload, 5, false, false).await;
}

async fn leased_lost_commit_replies(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Commit, 4, true, false).await;
}

/// The completion's `COMMIT` rides with it: a lost reply loses the completion's too, and the
/// evidence read with the take resolves it.
async fn lost_commit_replies_two_flights(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Commit, 4, false, true).await;
}

/// The take rides with `BEGIN`: cut, the transaction never began on the client's side. On
/// PostgreSQL the take is `EXECUTE` of a statement prepared on the connection (its text
/// crosses once): the message is known by its `BEGIN`.
async fn cut_after_the_take_two_flights(db: Option<TestDb>) {
    let postgres = db
        .as_ref()
        .is_some_and(|db| db.db.get_database_backend() == sea_orm::DbBackend::Postgres);
    let cut = if postgres {
        CutAfter::Begin
    } else {
        CutAfter::Reload
    };
    jobs_through_cuts(db, cut, 5, false, true).await;
}

async fn leased_lost_commit_replies_two_flights(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Commit, 4, true, true).await;
}

async fn black_holed_savepoint(db: Option<TestDb>) {
    black_holed_savepoint_in(db, false).await;
}

/// The savepoints on a held connection are freshlock's own statements.
async fn black_holed_savepoint_two_flights(db: Option<TestDb>) {
    black_holed_savepoint_in(db, true).await;
}

/// A savepoint's statement whose reply never comes (a silent partition): after a handler
/// failed in a batch's first attempt, the attempt runs again with a savepoint per job, and the
/// first savepoint is black-holed. The attempt gives up after the session policy's reply bound
/// (1 s) instead of waiting for TCP (hours) with the jobs' keys held, runs again on another
/// connection (the server ends the abandoned transaction: its idle-transaction timeout), and
/// each job ends once: the failing one failed, the other's effect in the database once.
async fn black_holed_savepoint_in(db: Option<TestDb>, two_flights: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let handlers = Jobs::new()
        .handle(
            "fails",
            job_support::at_once(1),
            jobs::handler(|_tx, _job: Job<i32>| {
                Box::pin(async { Err(freshlock::ApplyError::msg("fails")) })
            }),
        )
        .handle("bump", RetryPolicy::default(), bump_node);
    for kind in ["fails", "bump"] {
        job_support::add(&db.db, NewJob::new(kind, &1).unwrap())
            .await
            .unwrap();
    }
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Savepoint).await;
    let options = proxy::idle_transactions_end(options_through(&proxy, &db, true));
    let proxied = sea_orm::Database::connect(options).await.unwrap();
    let policy = LockPolicy::default().with_reply_timeout(Duration::from_secs(1));
    let session = Session::builder(proxied)
        .policy(policy)
        .two_flights(two_flights)
        .build()
        .unwrap();
    let worker = Worker::new(session, handlers).with_batch(2);
    proxy.black_hole(true);
    proxy.cut_once();
    let started = std::time::Instant::now();
    let runs = tokio::time::timeout(Duration::from_secs(25), worker.run_until_idle())
        .await
        .expect("no job hangs on a black-holed savepoint")
        .unwrap();
    eprintln!(
        "black-holed savepoint: {} cut, {runs:?} in {:?}",
        proxy.cuts(),
        started.elapsed()
    );
    assert_eq!(proxy.cuts(), 1, "a savepoint's reply was black-holed");
    let mut outcomes: Vec<_> = runs.iter().map(|r| (r.kind.as_str(), &r.outcome)).collect();
    outcomes.sort_by_key(|(kind, _)| *kind);
    assert!(
        matches!(
            outcomes.as_slice(),
            [
                ("bump", JobOutcome::Completed),
                ("fails", JobOutcome::Failed(_))
            ]
        ),
        "each job ended once: {outcomes:?}"
    );
    assert_eq!(job_support::total_score(&db.db).await, 1, "bumped once");
    assert_eq!(job_support::jobs_in(&db.db, 2).await, 1, "one job done");
}

on_databases! {
    job_savepoint_black_holed_postgres: black_holed_savepoint, postgres;
    job_savepoint_black_holed_mysql: black_holed_savepoint, mysql;
    job_commit_replies_lost_postgres: lost_commit_replies, postgres;
    job_commit_replies_lost_mysql: lost_commit_replies, mysql;
    job_takes_cut_postgres: cut_after_the_take, postgres;
    job_takes_cut_mysql: cut_after_the_take, mysql;
    leased_job_commit_replies_lost_postgres: leased_lost_commit_replies, postgres;
    leased_job_commit_replies_lost_mysql: leased_lost_commit_replies, mysql;
    job_savepoint_black_holed_two_flights_postgres: black_holed_savepoint_two_flights, postgres;
    job_savepoint_black_holed_two_flights_mysql: black_holed_savepoint_two_flights, mysql;
    job_commit_replies_lost_two_flights_postgres: lost_commit_replies_two_flights, postgres;
    job_commit_replies_lost_two_flights_mysql: lost_commit_replies_two_flights, mysql;
    job_takes_cut_two_flights_postgres: cut_after_the_take_two_flights, postgres;
    job_takes_cut_two_flights_mysql: cut_after_the_take_two_flights, mysql;
    leased_commits_lost_two_flights_postgres: leased_lost_commit_replies_two_flights, postgres;
    leased_commits_lost_two_flights_mysql: leased_lost_commit_replies_two_flights, mysql;
}
