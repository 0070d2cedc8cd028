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

/// `nodes` nodes, and [`JOBS`] jobs of `kind` that bump them in turn: each node's jobs keyed
/// by it, the last node's unkeyed.
async fn enqueue_bumps(db: &TestDb, kind: &str, nodes: i32) {
    db.seed_nodes(nodes).await;
    for seq in 0..JOBS {
        let node = seq % nodes + 1;
        let job = NewJob::new(kind, &node).unwrap();
        let job = if node < nodes {
            job.key(format!("node:{node}"))
        } else {
            job
        };
        jobs::enqueue(&db.db, job).await.unwrap();
    }
}

async fn number(db: &DatabaseConnection, sql: &str) -> i64 {
    let row = db
        .query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<Option<i64>>(0).unwrap().unwrap_or(0)
}

/// How the storm's jobs run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    /// In the job's transaction, bumping a node.
    InTx,
    /// Leased, the finish bumping the node.
    Leased,
    /// Leased, the finish sending nothing: its transaction is its last message alone with two
    /// flights (on PostgreSQL a commit marker rides in it, not the transaction's id).
    Quiet,
}

/// `two_flights`: the session's jobs in few round trips (`SessionBuilder::two_flights`: the take
/// in `BEGIN`'s message, the completion in `COMMIT`'s).
async fn jobs_through_cuts(
    db: Option<TestDb>,
    cut: CutAfter,
    every: u32,
    form: Form,
    two_flights: bool,
) {
    let leased = form != Form::InTx;
    let Some(db) = db else { return };
    enqueue_bumps(&db, "bump", 5).await;
    let proxy = Proxy::start(proxy::target(&db.url), cut).await;
    let proxied = through(&proxy, &db, cut == CutAfter::Reload).await;
    proxy.cut_every(every);
    let handlers = if leased {
        // Claimed under a 1 s lease (its commit cut too), worked outside, finished fenced.
        let work =
            |job: Job<i32>, _lease| async move { Ok::<_, freshlock::ApplyError>(job.payload) };
        let lease = Duration::from_secs(1);
        match form {
            Form::Quiet => Jobs::new().handle_leased(
                "bump",
                RetryPolicy::default(),
                lease,
                work,
                async |_tx: &freshlock::Tx, _job: Job<i32>, _node: &i32| Ok(()),
            ),
            _ => {
                Jobs::new().handle_leased("bump", RetryPolicy::default(), lease, work, bump_output)
            }
        }
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
        "{cut:?} ({form:?}, two flights: {two_flights}): {} cut; {acknowledged} acknowledged, {unknown} unknown",
        proxy.cuts()
    );
    assert!(proxy.cuts() >= 5, "the proxy cut connections");
    assert_eq!(unknown, 0, "every lost reply was resolved");
    assert_eq!(number(&db.db, done_sql).await, i64::from(JOBS));
    assert_eq!(
        acknowledged, JOBS as u32,
        "each job acknowledged exactly once"
    );
    // A quiet finish has no effect but its completion, counted above.
    let effects = if form == Form::Quiet { 0 } else { JOBS };
    assert_eq!(
        number(&db.db, sum).await,
        i64::from(effects),
        "every job's effect is in the database exactly once"
    );
}

/// Keyed jobs as a worker's loop runs them (`Worker::run`), a key's next jobs chained: an
/// in-transaction job's into its transaction, a leased job's claimed by its finish (on
/// MySQL/MariaDB in the finish's own message, `store::Chained`), with every fourth `COMMIT`'s
/// reply lost. `Worker::run` reports nothing per job, so what it acknowledged is counted where
/// an operator sees it: the `freshlock_jobs_total{outcome=completed}` counter, which a worker
/// increments once a job's transaction committed (or its lost reply was resolved as committed).
/// Every job is done, each acknowledged once, each effect in the database once. `nodes`: the
/// jobs bump that many nodes, each but the last's keyed by it (see [`enqueue_bumps`]).
#[cfg(feature = "metrics")]
async fn chains_through_cuts(db: Option<TestDb>, leased: bool, two_flights: bool, nodes: i32) {
    let Some(db) = db else { return };
    // The kind names the test: the counter is the process's, shared with other tests.
    let kind = format!(
        "chain-{:?}-{leased}-{two_flights}-{nodes}",
        db.db.get_database_backend()
    );
    // With 3 nodes, two hot keys and unkeyed jobs: a key's jobs wait behind its running one,
    // so a worker's finish (or its transaction) goes on with the key's next.
    enqueue_bumps(&db, &kind, nodes).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let proxied = through(&proxy, &db, false).await;
    proxy.cut_every(4);
    let handlers = if leased {
        let work =
            |job: Job<i32>, _lease| async move { Ok::<_, freshlock::ApplyError>(job.payload) };
        // No claim here waits out its lease: a job claimed by a finish whose reply was lost
        // (the commit resolved as made) is read back by its claim's owner and runs at once.
        let lease = Duration::from_secs(3600);
        Jobs::new().handle_leased(
            kind.as_str(),
            RetryPolicy::default(),
            lease,
            work,
            bump_output,
        )
    } else {
        Jobs::new().handle(kind.as_str(), RetryPolicy::default(), bump_node)
    };
    let session = Session::builder(proxied)
        .two_flights(two_flights)
        .build()
        .unwrap();
    let completed_before = completed_counter(&kind);
    let worker = Worker::new(session, handlers)
        .with_poll(Duration::from_millis(5), Duration::from_millis(50));
    let running: Vec<_> = (0..WORKERS)
        .map(|_| job_support::run_in_background(worker.clone()))
        .collect();
    let done_sql = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while number(&db.db, done_sql).await < i64::from(JOBS) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the jobs did not finish"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Each worker finishes the job it runs (its commit and its count included), then stops.
    let mut ran = 0;
    for (stop, task) in running {
        let _ = stop.send(());
        ran += task.await.unwrap();
    }
    let acknowledged = completed_counter(&kind) - completed_before;
    eprintln!(
        "chains (leased: {leased}, two flights: {two_flights}): {} cut; {ran} ran, {acknowledged} acknowledged",
        proxy.cuts()
    );
    assert!(proxy.cuts() >= 5, "the proxy cut connections");
    assert_eq!(number(&db.db, done_sql).await, i64::from(JOBS));
    assert_eq!(
        acknowledged,
        u64::from(JOBS.unsigned_abs()),
        "each job acknowledged exactly once"
    );
    assert_eq!(
        job_support::total_score(&db.db).await,
        i64::from(JOBS),
        "every job's effect is in the database exactly once"
    );
}

/// How many of `kind`'s jobs the process's workers counted completed
/// (`freshlock_jobs_total{kind, outcome=completed}`), from a recorder this test binary installs
/// once. A snapshot zeroes the recorder's counters, so every reading adds them up here.
#[cfg(feature = "metrics")]
fn completed_counter(kind: &str) -> u64 {
    use std::{
        collections::BTreeMap,
        sync::{Mutex, OnceLock},
    };

    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

    static SNAPSHOTS: OnceLock<Snapshotter> = OnceLock::new();
    static TOTALS: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());
    let snapshotter = SNAPSHOTS.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("no other metrics recorder in this test binary");
        snapshotter
    });
    let mut totals = TOTALS.lock().unwrap();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let label = |name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map(|l| l.value().to_owned())
        };
        if let (DebugValue::Counter(n), Some(kind), Some("completed")) =
            (value, label("kind"), label("outcome").as_deref())
            && key.name() == freshlock::metrics::JOBS
        {
            *totals.entry(kind).or_default() += n;
        }
    }
    totals.get(kind).copied().unwrap_or(0)
}

#[cfg(feature = "metrics")]
async fn chained_cuts(db: Option<TestDb>) {
    chains_through_cuts(db, false, false, 3).await;
}

#[cfg(feature = "metrics")]
async fn chained_cuts_two_flights(db: Option<TestDb>) {
    chains_through_cuts(db, false, true, 3).await;
}

/// Unkeyed jobs in a worker's loop with two flights: every job's last message carries the next
/// take after its `COMMIT` (`jobs/flights/pretake.rs`), so a lost reply loses the take's too,
/// and the rows it locked stay with the lost connection's transaction.
#[cfg(feature = "metrics")]
async fn loop_cuts_two_flights(db: Option<TestDb>) {
    chains_through_cuts(db, false, true, 1).await;
}

#[cfg(feature = "metrics")]
async fn leased_chained_cuts(db: Option<TestDb>) {
    chains_through_cuts(db, true, false, 3).await;
}

#[cfg(feature = "metrics")]
async fn leased_chained_cuts_two_flights(db: Option<TestDb>) {
    chains_through_cuts(db, true, true, 3).await;
}

async fn lost_commit_replies(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Commit, 4, Form::InTx, false).await;
}

async fn cut_after_the_take(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Reload, 5, Form::InTx, false).await;
}

async fn leased_lost_commit_replies(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Commit, 4, Form::Leased, false).await;
}

/// The completion's `COMMIT` rides with it: a lost reply loses the completion's too, and the
/// evidence read with the take resolves it.
async fn lost_commit_replies_two_flights(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Commit, 4, Form::InTx, true).await;
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
    jobs_through_cuts(db, cut, 5, Form::InTx, true).await;
}

async fn leased_lost_commit_replies_two_flights(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Commit, 4, Form::Leased, true).await;
}

/// A finish that sends nothing is one message with two flights — `BEGIN`, the commit marker,
/// the completion, its check, `COMMIT` — its lost reply resolved by the marker.
async fn quiet_lost_commit_replies_two_flights(db: Option<TestDb>) {
    jobs_through_cuts(db, CutAfter::Commit, 4, Form::Quiet, true).await;
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
    quiet_commits_lost_two_flights_postgres: quiet_lost_commit_replies_two_flights, postgres;
    quiet_commits_lost_two_flights_mysql: quiet_lost_commit_replies_two_flights, mysql;
}

#[cfg(feature = "metrics")]
on_databases! {
    job_chain_cuts_postgres: chained_cuts, postgres;
    job_chain_cuts_mysql: chained_cuts, mysql;
    job_chain_cuts_flights_postgres: chained_cuts_two_flights, postgres;
    job_chain_cuts_flights_mysql: chained_cuts_two_flights, mysql;
    leased_chain_cuts_postgres: leased_chained_cuts, postgres;
    leased_chain_cuts_mysql: leased_chained_cuts, mysql;
    leased_chain_cuts_flights_postgres: leased_chained_cuts_two_flights, postgres;
    leased_chain_cuts_flights_mysql: leased_chained_cuts_two_flights, mysql;
    job_loop_cuts_flights_postgres: loop_cuts_two_flights, postgres;
    job_loop_cuts_flights_mysql: loop_cuts_two_flights, mysql;
}
