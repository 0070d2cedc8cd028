//! Job limits (`jobs::Limit`) on SQLite, PostgreSQL and MariaDB: a running limit is never
//! exceeded while other kinds drain and a worker with nothing admissible returns at once, in a
//! job's transaction and leased; a rate spaces a kind's starts; a per-key rate spaces one key's
//! starts while every other key drains; a limit of zero pauses a kind; prune forgets free rate
//! tokens. Every acknowledged job's effect is in the rows, once.

#[macro_use]
#[path = "common/job_support.rs"]
mod job_support;
#[path = "common/servers.rs"]
mod servers;

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use freshlock::{
    Session,
    jobs::{self, Enqueued, Job, JobOutcome, Jobs, Lease, Limit, NewJob, Prune, Worker},
};
use job_support::{add, at_once, bump, bump_node, bump_output, number, total_score};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement, TransactionTrait};
use servers::{TestDb, databases};
use tokio::{sync::watch, task::JoinSet};

/// How long a test waits for what must happen before it fails instead of hanging.
const WITHIN: Duration = Duration::from_secs(60);

/// Enqueues a job of `kind` bumping `node`, keyed `key` if given.
async fn enqueue(db: &DatabaseConnection, kind: &str, node: i32, key: Option<&str>) {
    let mut job = NewJob::new(kind, &node).unwrap();
    if let Some(key) = key {
        job = job.key(key);
    }
    assert!(matches!(add(db, job).await.unwrap(), Enqueued::Added(_)));
}

/// Polls `condition` until it holds; fails (naming `what`) after [`WITHIN`].
async fn until<F: Future<Output = bool>>(what: &str, mut condition: impl FnMut() -> F) {
    let deadline = Instant::now() + WITHIN;
    while !condition().await {
        assert!(Instant::now() < deadline, "{what}: not within {WITHIN:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// How many jobs run at once, and the most that ever did.
#[derive(Default)]
struct Gauge {
    running: AtomicUsize,
    most: AtomicUsize,
}

impl Gauge {
    fn enter(&self) {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs `workers` workers of `handlers` until `stop` says so; their runs, summed.
fn start(db: &TestDb, handlers: &Jobs, workers: usize, stop: &watch::Sender<bool>) -> JoinSet<u64> {
    let mut set = JoinSet::new();
    for _ in 0..workers {
        let worker = Worker::new(Session::new(&db.handle), handlers.clone())
            .with_poll(Duration::from_millis(1), Duration::from_millis(10));
        let mut stopped = stop.subscribe();
        set.spawn(async move {
            let stopping = async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            };
            worker.run(stopping).await.expect("the worker runs")
        });
    }
    set
}

/// Stops the workers of `set`: how many jobs they ran.
async fn stop(set: JoinSet<u64>, stop: &watch::Sender<bool>) -> u64 {
    stop.send(true).unwrap();
    set.join_all().await.into_iter().sum()
}

/// Five `slow` jobs under `Limit::running(2)` that wait for the test, and twelve `fast` ones,
/// on three workers: two slow jobs run, the third worker drains every fast job and a fourth
/// worker's `run_one` returns at once with nothing; once released every job completes, and no
/// more than two slow jobs ever ran at once. `leased`: the slow kind works outside any
/// transaction (`handle_leased`), counted by its live leases.
async fn running_limit_holds_while_others_drain(db: Option<TestDb>, leased: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(17).await;
    for node in 1..=5 {
        enqueue(&db.db, "slow", node, None).await;
    }
    for node in 6..=17 {
        enqueue(&db.db, "fast", node, Some(&format!("k{node}"))).await;
    }
    let gauge = Arc::new(Gauge::default());
    let (release, released) = watch::channel(false);
    let handlers = Jobs::new().handle("fast", at_once(3), bump_node);
    let handlers = if leased {
        let (gauge, released) = (Arc::clone(&gauge), released.clone());
        handlers.handle_leased(
            "slow",
            at_once(3),
            Duration::from_secs(30),
            move |job: Job<i32>, _lease: Lease| {
                let (gauge, mut released) = (Arc::clone(&gauge), released.clone());
                async move {
                    gauge.enter();
                    let _ = released.wait_for(|go| *go).await;
                    gauge.leave();
                    Ok(job.payload)
                }
            },
            bump_output,
        )
    } else {
        let (gauge, released) = (Arc::clone(&gauge), released.clone());
        handlers.handle(
            "slow",
            at_once(3),
            jobs::handler(move |tx, job: Job<i32>| {
                let (gauge, mut released) = (Arc::clone(&gauge), released.clone());
                Box::pin(async move {
                    gauge.enter();
                    let _ = released.wait_for(|go| *go).await;
                    gauge.leave();
                    bump(tx, job.payload).await?;
                    Ok(())
                })
            }),
        )
    }
    .limit("slow", Limit::running(2));
    let (stopper, _) = watch::channel(false);
    let workers = start(&db, &handlers, 3, &stopper);

    until("two slow jobs run and every fast job completed", || async {
        gauge.running.load(Ordering::SeqCst) == 2 && total_score(&db.db).await == 12
    })
    .await;
    // Three slow jobs wait, over the limit: a worker is handed nothing, and does not wait.
    let extra = Worker::new(Session::new(&db.handle), handlers.clone());
    let nothing = tokio::time::timeout(WITHIN, extra.run_one()).await;
    assert!(
        matches!(nothing, Ok(Ok(None))),
        "nothing admissible: {nothing:?}"
    );
    assert_eq!(gauge.most.load(Ordering::SeqCst), 2);

    release.send(true).unwrap();
    until("every job completed", || async {
        total_score(&db.db).await == 17
    })
    .await;
    let ran = stop(workers, &stopper).await;
    assert_eq!(ran, 17, "every job ran once");
    assert_eq!(gauge.most.load(Ordering::SeqCst), 2, "never over the limit");
    assert_eq!(
        total_score(&db.db).await,
        17,
        "every acknowledged job's effect, once"
    );
    assert_eq!(
        number(&db.db, "SELECT COUNT(*) FROM freshlock_job WHERE state = 2").await,
        17
    );
}

async fn running_limit_in_tx(db: Option<TestDb>) {
    running_limit_holds_while_others_drain(db, false).await;
}

async fn running_limit_leased(db: Option<TestDb>) {
    running_limit_holds_while_others_drain(db, true).await;
}

/// The table where the jobs of the rate tests note when they started: in the job's
/// transaction, on the database's clock (the clock of the limits' tokens), so only attempts
/// that committed are counted.
async fn make_starts_table(db: &DatabaseConnection) {
    db.execute_unprepared(
        "CREATE TABLE limit_start (job_id BIGINT NOT NULL, job_key VARCHAR(64), at_ms BIGINT NOT NULL)",
    )
    .await
    .unwrap();
}

/// Milliseconds since the epoch on the database's clock, in `backend`'s dialect.
fn now_ms(backend: DbBackend) -> &'static str {
    match backend {
        DbBackend::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        DbBackend::MySql => "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
        _ => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    }
}

/// Handlers of `kind` that note when each job starts (`limit_start`) and bump its node.
fn noting(jobs: Jobs, kind: &str) -> Jobs {
    jobs.handle(
        kind,
        at_once(3),
        jobs::handler(move |tx, job: Job<i32>| {
            Box::pin(async move {
                let backend = tx.get_database_backend();
                let key = job
                    .key
                    .as_deref()
                    .map_or("NULL".to_owned(), |k| format!("'{k}'"));
                let sql = format!(
                    "INSERT INTO limit_start (job_id, job_key, at_ms) VALUES ({}, {key}, {})",
                    job.id,
                    now_ms(backend)
                );
                tx.execute_unprepared(&sql).await?;
                bump(tx, job.payload).await?;
                Ok(())
            })
        }),
    )
}

/// The committed starts, in time order: (key, milliseconds on the database's clock).
async fn starts(db: &TestDb) -> Vec<(Option<String>, i64)> {
    let txn = db.db.begin().await.unwrap();
    let rows = txn
        .query_all_raw(Statement::from_string(
            db.db.get_database_backend(),
            "SELECT job_key, at_ms FROM limit_start ORDER BY at_ms",
        ))
        .await
        .unwrap();
    txn.commit().await.unwrap();
    (rows.iter())
        .map(|row| {
            (
                row.try_get("", "job_key").unwrap(),
                row.try_get("", "at_ms").unwrap(),
            )
        })
        .collect()
}

/// Runs `handlers` on two workers until the `total` jobs enqueued completed (their effects
/// in the rows) and each ran once: their committed starts, in time order.
async fn starts_of(db: &TestDb, handlers: &Jobs, total: i64) -> Vec<(Option<String>, i64)> {
    let (stopper, _) = watch::channel(false);
    let workers = start(db, handlers, 2, &stopper);
    until("every job completed", || async {
        total_score(&db.db).await == total
    })
    .await;
    assert_eq!(
        stop(workers, &stopper).await,
        total as u64,
        "every job ran once"
    );
    let starts = starts(db).await;
    assert_eq!(starts.len() as i64, total, "each job committed once");
    starts
}

/// The period of the rates below, and how much earlier than it a start may be seen (the time
/// between a take's token and its handler's first step).
const PER: Duration = Duration::from_millis(1000);
const PER_MS: i64 = 1000;
const SLACK_MS: i64 = 200;

/// Nine jobs under `Limit::rate(3, PER)` on two workers: any four consecutive starts span at
/// least a period (the fourth reuses a token), so nine take at least two periods.
async fn rate_spaces_starts(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    for _ in 0..9 {
        enqueue(&db.db, "rated", 1, None).await;
    }
    make_starts_table(&db.db).await;
    let handlers = noting(Jobs::new(), "rated").limit("rated", Limit::rate(3, PER));
    let at: Vec<i64> = (starts_of(&db, &handlers, 9).await.into_iter())
        .map(|(_, at)| at)
        .collect();
    for window in at.windows(4) {
        let span = window[3] - window[0];
        assert!(
            span >= PER_MS - SLACK_MS,
            "four starts within {span} ms: over the rate"
        );
    }
}

/// A hot key's three jobs under `Limit::rate_per_key(1, PER)` and ten other keys' jobs, on two
/// workers: the hot key's starts are a period apart, and every other key's job completed before
/// the hot key's second start — nobody waited for the limited key.
async fn rate_per_key_leaves_other_keys_draining(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    for _ in 0..3 {
        enqueue(&db.db, "sync", 1, Some("hot")).await;
    }
    for other in 0..10 {
        enqueue(&db.db, "sync", 1, Some(&format!("cold{other}"))).await;
    }
    make_starts_table(&db.db).await;
    let handlers = noting(Jobs::new(), "sync").limit("sync", Limit::rate_per_key(1, PER));
    let starts = starts_of(&db, &handlers, 13).await;
    let hot: Vec<i64> = (starts.iter())
        .filter(|(key, _)| key.as_deref() == Some("hot"))
        .map(|(_, at)| *at)
        .collect();
    assert_eq!(hot.len(), 3);
    for pair in hot.windows(2) {
        assert!(
            pair[1] - pair[0] >= PER_MS - SLACK_MS,
            "the hot key over its rate"
        );
    }
    let last_cold = (starts.iter())
        .filter(|(key, _)| key.as_deref() != Some("hot"))
        .map(|(_, at)| *at)
        .max()
        .unwrap();
    assert!(
        last_cold < hot[1],
        "the other keys drained while the hot key waited"
    );
}

/// `Limit::running(0)` pauses a kind: its jobs wait while another kind's run; with the limit
/// lifted they run. Rate tokens free again are forgotten by `prune`; held tokens stay.
async fn zero_pauses_and_prune_forgets_free_tokens(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(2).await;
    enqueue(&db.db, "paused", 1, None).await;
    enqueue(&db.db, "open", 2, Some("a")).await;
    enqueue(&db.db, "open", 2, Some("b")).await;
    let handlers = Jobs::new()
        .handle("paused", at_once(3), bump_node)
        .handle("open", at_once(3), bump_node)
        .limit("paused", Limit::running(0))
        .limit("open", Limit::rate_per_key(1, Duration::ZERO));
    let worker = Worker::new(Session::new(&db.handle), handlers.clone());
    let runs = worker.run_until_idle().await.unwrap();
    assert_eq!(runs.len(), 2);
    assert!(runs.iter().all(|run| run.outcome == JobOutcome::Completed));
    assert_eq!(db.score(1).await, None, "the paused kind waits");
    assert_eq!(db.score(2).await, Some(2));
    let tokens = "SELECT COUNT(*) FROM freshlock_job_slot";
    assert_eq!(
        number(&db.db, tokens).await,
        3,
        "a rate token per key, and the keyless jobs' one"
    );

    let lifted = handlers.limit("paused", Limit::running(1));
    let runs = Worker::new(Session::new(&db.handle), lifted)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(db.score(1).await, Some(1));
    assert_eq!(
        number(&db.db, tokens).await,
        4,
        "and the running limit's one token"
    );

    jobs::prune(&db.handle, Duration::ZERO, Prune::Finished)
        .await
        .unwrap();
    assert_eq!(
        number(&db.db, tokens).await,
        1,
        "the free rate tokens are forgotten, the held one stays"
    );
}

on_databases! {
    running_limit_in_tx_postgres: running_limit_in_tx, postgres;
    running_limit_in_tx_mysql: running_limit_in_tx, mysql;
    running_limit_leased_sqlite: running_limit_leased, sqlite;
    running_limit_leased_postgres: running_limit_leased, postgres;
    running_limit_leased_mysql: running_limit_leased, mysql;
    rate_sqlite: rate_spaces_starts, sqlite;
    rate_postgres: rate_spaces_starts, postgres;
    rate_mysql: rate_spaces_starts, mysql;
    rate_per_key_sqlite: rate_per_key_leaves_other_keys_draining, sqlite;
    rate_per_key_postgres: rate_per_key_leaves_other_keys_draining, postgres;
    rate_per_key_mysql: rate_per_key_leaves_other_keys_draining, mysql;
    paused_sqlite: zero_pauses_and_prune_forgets_free_tokens, sqlite;
    paused_postgres: zero_pauses_and_prune_forgets_free_tokens, postgres;
    paused_mysql: zero_pauses_and_prune_forgets_free_tokens, mysql;
}
