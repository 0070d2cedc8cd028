//! Keyed jobs (`freshlock::jobs`) against the job-queue table of issue 27, on PostgreSQL and
//! MariaDB (whichever URL is set), one run printing the figures BENCHMARKS.md §10 records:
//!
//! - W1: no-op jobs/s with 1 and 8 workers, one job per transaction and batches of 64;
//! - W2: jobs/s where each job updates one row (its write and its completion commit together:
//!   exactly once), 8 workers, one job per transaction and batches of 32 — by a plain `UPDATE`,
//!   then as a locked update (the row read `FOR UPDATE` through the job's `TxRepository`, its
//!   changed column saved, guarded);
//! - W3: 2,000 jobs of 10 ms, half on one key, the rest over 50 keys, one job per key at a time,
//!   10 workers: wall time, the other keys' p50/p99 latency (from the start, when every job is
//!   already enqueued), same-key overlaps seen by the handlers; then its hot key by hand, the
//!   floor of the leased form (`jobs/by_hand.rs`).
//!
//! `cargo bench --bench jobs --all-features` with `DATABASE_URL_POSTGRES` and/or
//! `DATABASE_URL_MYSQL`; `FRESHLOCK_BENCH_QUICK=1` runs a tenth of each workload,
//! `FRESHLOCK_BENCH_ONLY=w1` (or `w2`, `w3`) only that one, `FRESHLOCK_BENCH_ROWS=100` W2 on
//! that many rows (default 1,000; count deadlocks in the server's log or `Innodb_deadlocks`),
//! `FRESHLOCK_BENCH_RUNS=10` W2 that many times, `FRESHLOCK_BENCH_FORM=leased` (or `tx`) W3
//! in that form only, `FRESHLOCK_BENCH_FLIGHTS=1` (or `0`) W2 and W3 in two flights (or on the
//! engine) only, `FRESHLOCK_BENCH_PING=1` with sqlx's
//! checkout ping on (off by default, as README's *Reliability* recommends),
//! `FRESHLOCK_BENCH_DELAY_US=1000` every connection through a link adding that many
//! microseconds each way (`tests/common/delay.rs`, as the floor's), `FRESHLOCK_BENCH_HISTORY=
//! 50000` W3 with that many done jobs of its hot key in the table. The databases' `node` and
//! `freshlock_job` tables are emptied first.

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[path = "jobs/by_hand.rs"]
mod by_hand;
mod common;
#[path = "../tests/common/delay.rs"]
mod delay;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use entity::node;
use freshlock::{
    ForUpdate, SaveOutcome, Session, Tx,
    jobs::{self, Job, Jobs, NewJob, RetryPolicy, Worker},
};
use sea_orm::{
    ActiveValue::Set, ConnectionTrait, DatabaseConnection, IntoActiveModel, Statement,
    TransactionTrait,
};
use workload::percentile_ms;

/// Whether workload `name` runs: `FRESHLOCK_BENCH_ONLY` names one (`w1`, `w2`, `w3`), or all.
fn only(name: &str) -> bool {
    std::env::var("FRESHLOCK_BENCH_ONLY").map_or(true, |only| only.eq_ignore_ascii_case(name))
}

/// Whether W2 and W3 run on the engine, in two flights, or both: `FRESHLOCK_BENCH_FLIGHTS=1`
/// (two flights only) or `0` (the engine only), else both.
fn flight_forms() -> Vec<bool> {
    match std::env::var("FRESHLOCK_BENCH_FLIGHTS").as_deref() {
        Ok("1") => vec![true],
        Ok("0") => vec![false],
        _ => vec![false, true],
    }
}

/// W3's forms (leased or not): `FRESHLOCK_BENCH_FORM` names one (`leased`, `tx`), or both.
fn w3_forms() -> Vec<bool> {
    match std::env::var("FRESHLOCK_BENCH_FORM").as_deref() {
        Ok("leased") => vec![true],
        Ok("tx") => vec![false],
        _ => vec![false, true],
    }
}

fn quick() -> bool {
    std::env::var_os("FRESHLOCK_BENCH_QUICK").is_some()
}

/// The number in environment variable `name`, else `default`.
fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

/// W2's counter rows: `FRESHLOCK_BENCH_ROWS` (the peers' harness uses 100), else 1,000.
fn rows() -> usize {
    env_number("FRESHLOCK_BENCH_ROWS", 1000)
}

/// The pool's connections: `FRESHLOCK_BENCH_POOL`, else 16 (sqlx pings each connection given
/// back before it is taken again: through a link with latency a returned connection is busy
/// for a round trip).
fn pool_size() -> u32 {
    u32::try_from(env_number("FRESHLOCK_BENCH_POOL", 16)).unwrap_or(16)
}

/// How many times W2 runs: `FRESHLOCK_BENCH_RUNS`, else once.
fn runs() -> usize {
    env_number("FRESHLOCK_BENCH_RUNS", 1)
}

fn scaled(n: usize) -> usize {
    if quick() { n / 10 } else { n }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    for (name, var) in [
        ("PostgreSQL", "DATABASE_URL_POSTGRES"),
        ("MariaDB", "DATABASE_URL_MYSQL"),
    ] {
        let Ok(url) = std::env::var(var) else {
            println!("({name}: skipped: {var} is not set)");
            continue;
        };
        // Through a link with latency, when asked: every connection of the run.
        let link = std::env::var("FRESHLOCK_BENCH_DELAY_US")
            .ok()
            .and_then(|us| us.trim().parse::<u64>().ok())
            .map(|us| {
                let one_way = Duration::from_micros(us);
                delay::DelayProxy::start(delay::target(&url), one_way).expect("the delay proxy")
            });
        let url = link.as_ref().map_or(url.clone(), |proxy| proxy.url(&url));
        match &link {
            Some(proxy) => println!(
                "\n## {name}, through a link of {} µs each way\n",
                proxy.one_way.as_micros()
            ),
            None => println!("\n## {name}\n"),
        }
        // Without sqlx's checkout ping, as README's *Reliability* recommends: one round trip
        // less per transaction (a connection that died idle is tried again by freshlock).
        let ping = std::env::var_os("FRESHLOCK_BENCH_PING").is_some();
        let db = common::database_with(&url, 1000, pool_size(), ping).await;
        println!("| workload | workers | batch | jobs | seconds | jobs/s |");
        println!("|---|---|---|---|---|---|");
        if only("w1") {
            for (workers, batch, n) in [
                (1, 1, 5_000),
                (8, 1, 5_000),
                (1, 64, 20_000),
                (8, 64, 20_000),
                (4, 256, 20_000),
                (8, 256, 20_000),
            ] {
                no_ops(&db, scaled(n), workers, batch, false).await;
            }
            // Leased: claimed in the take's transaction, worked outside any, finished in one
            // of its own each.
            for (workers, batch, n) in [(8, 1, 5_000), (4, 64, 20_000)] {
                no_ops(&db, scaled(n), workers, batch, true).await;
            }
        }
        if only("w2") {
            for _ in 0..runs() {
                for form in [Form::Update, Form::Locked, Form::Leased] {
                    for batch in [1, 32] {
                        for two_flights in flight_forms() {
                            updates(&db, scaled(5_000), 8, batch, form, two_flights).await;
                        }
                    }
                }
            }
        }
        if only("w3") {
            for leased in w3_forms() {
                for two_flights in flight_forms() {
                    skewed(&db, leased, two_flights).await;
                }
            }
            #[cfg(any(feature = "postgres", feature = "mysql"))]
            by_hand::hot_key(&db, scaled(2_000) / 2).await;
        }
    }
}

/// Empties the queue and enqueues `n` jobs made by `job`, in transactions of 1,000.
///
/// `TRUNCATE`, not `DELETE`: this machine's PostgreSQL runs with `autovacuum = off`, so a
/// `DELETE` leaves every earlier run's rows behind as dead tuples, and each take's index scan
/// then wades through them (hundreds of thousands after a few runs: 5 ms per take instead of
/// 0.1). A server with autovacuum (the default) cleans them up by itself.
///
/// Then `ANALYZE`, as autovacuum's analyze would soon after such a fill: a table emptied by
/// `TRUNCATE` has no statistics, and PostgreSQL's planner then sorts every pending job for a
/// take instead of following `freshlock_job_next` (6 ms per take with 4,000 pending, measured
/// here; W1 at 220 jobs/s instead of 900).
async fn fill(db: &DatabaseConnection, n: usize, job: impl Fn(usize) -> NewJob) {
    db.execute_unprepared("TRUNCATE TABLE freshlock_job")
        .await
        .expect("empty the queue");
    let began = Instant::now();
    enqueue(db, n, job).await;
    println!(
        "filled {n} jobs in {:.3} s (enqueue_many)",
        began.elapsed().as_secs_f64()
    );
    analyze(db).await;
}

/// Enqueues `n` jobs made by `job`: one transaction and one statement per 1,000 jobs
/// (`enqueue_many`).
async fn enqueue(db: &DatabaseConnection, n: usize, job: impl Fn(usize) -> NewJob) {
    for start in (0..n).step_by(1000) {
        let txn = db.begin().await.expect("begin");
        let batch = (start..(start + 1000).min(n)).map(&job);
        jobs::enqueue_many(&txn, batch).await.expect("enqueue");
        txn.commit().await.expect("commit");
    }
}

/// The job table's statistics brought up to date (see [`fill`]).
async fn analyze(db: &DatabaseConnection) {
    let analyze = match db.get_database_backend() {
        sea_orm::DbBackend::MySql => "ANALYZE TABLE freshlock_job",
        _ => "ANALYZE freshlock_job",
    };
    db.execute_unprepared(analyze).await.expect("analyze");
}

/// `FRESHLOCK_BENCH_HISTORY=50000`: that many done jobs of W3's hot key in the table, as a key
/// has before its finished jobs are pruned (`jobs::prune`); none by default.
async fn history(db: &DatabaseConnection) {
    let n: usize = std::env::var("FRESHLOCK_BENCH_HISTORY")
        .ok()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    if n == 0 {
        return;
    }
    enqueue(db, n, |_| NewJob::new("past", &()).unwrap().key("ham:hot")).await;
    let done =
        "UPDATE freshlock_job SET state = 2, finished_at = created_at WHERE payload = 'null'";
    db.execute_unprepared(done).await.expect("the history done");
    analyze(db).await;
    println!("{n} done jobs of the hot key in the table");
}

/// Runs `workers` workers until `total` jobs completed: the seconds it took, and each job's
/// completion time from the start, by id (the time its worker's loop went idle). Each worker
/// loops as `Worker::run` does (`run_until_idle`: taking again at once after jobs ran, which
/// with two flights sends the next take after the `COMMIT`), and waits as it does when nothing
/// is due.
async fn drain(
    db: &DatabaseConnection,
    handlers: Jobs,
    workers: usize,
    batch: u32,
    total: usize,
    two_flights: bool,
) -> (f64, HashMap<i64, Duration>) {
    let session = Session::builder(db.clone())
        .two_flights(two_flights)
        .build()
        .expect("session");
    let done = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(Mutex::new(HashMap::new()));
    let start = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let worker = Worker::new(session.clone(), handlers.clone()).with_batch(batch);
            let (done, finished) = (Arc::clone(&done), Arc::clone(&finished));
            tokio::spawn(async move {
                // `Worker::run`'s own wait when nothing is due: 20 ms doubling to 1 s.
                let mut idle = Duration::from_millis(20);
                while done.load(Ordering::SeqCst) < total {
                    let runs = worker.run_until_idle().await.expect("run jobs");
                    if runs.is_empty() {
                        tokio::time::sleep(idle).await;
                        idle = (idle * 2).min(Duration::from_secs(1));
                        continue;
                    }
                    let at = start.elapsed();
                    let mut finished = finished.lock().unwrap();
                    for run in &runs {
                        finished.insert(run.id, at);
                    }
                    done.fetch_add(runs.len(), Ordering::SeqCst);
                    idle = Duration::from_millis(20);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("worker");
    }
    let finished = Arc::try_unwrap(finished).unwrap().into_inner().unwrap();
    // Until the last job completed (not until every idle worker woke up to see it).
    let seconds = finished
        .values()
        .max()
        .copied()
        .unwrap_or_default()
        .as_secs_f64();
    (seconds, finished)
}

fn row(workload: &str, workers: usize, batch: u32, n: usize, seconds: f64) {
    println!(
        "| {workload} | {workers} | {batch} | {n} | {seconds:.2} | {:.0} |",
        n as f64 / seconds
    );
}

/// W1: no-op jobs, in the take's transaction or (`leased`) claimed, worked and finished.
async fn no_ops(db: &DatabaseConnection, n: usize, workers: usize, batch: u32, leased: bool) {
    fill(db, n, |_| NewJob::new("noop", &()).unwrap()).await;
    let policy = RetryPolicy::default();
    let handlers = if leased {
        Jobs::new().handle_leased(
            "noop",
            policy,
            Duration::from_secs(30),
            |_job: Job<()>, _lease| async { Ok(()) },
            async |_tx: &Tx, _job: Job<()>, _: &()| Ok(()),
        )
    } else {
        Jobs::new().handle("noop", policy, async |_tx: &Tx, _job: Job<()>| Ok(()))
    };
    let (seconds, _) = drain(db, handlers, workers, batch, n, false).await;
    let name = if leased {
        "W1 no-op, leased"
    } else {
        "W1 no-op"
    };
    row(name, workers, batch, n, seconds);
}

/// How a W2 job adds its one.
#[derive(Clone, Copy, PartialEq)]
enum Form {
    /// A plain `UPDATE` in the job's transaction.
    Update,
    /// As a locked update does it, in the job's transaction.
    Locked,
    /// A leased job's finish runs the `UPDATE` (its work does nothing).
    Leased,
}

/// The `UPDATE` of W2: node `node`'s score plus one.
async fn bump(tx: &Tx, node: i32) -> Result<(), freshlock::ApplyError> {
    let backend = tx.get_database_backend();
    let sql = if backend == sea_orm::DbBackend::Postgres {
        "UPDATE node SET score = score + 1 WHERE id = $1"
    } else {
        "UPDATE node SET score = score + 1 WHERE id = ?"
    };
    tx.execute_raw(Statement::from_sql_and_values(backend, sql, [node.into()]))
        .await?;
    Ok(())
}

/// W2: each job adds one to a row, in the job's transaction: by a plain `UPDATE`, or (`locked`)
/// as a locked update does it — the row read locked and only its changed column saved, guarded
/// (`TxRepository::load_locked`, then `save`).
/// W2 in `form`; `two_flights`: on a session with `two_flights(true)` (the take with `BEGIN`,
/// the completion with `COMMIT`).
async fn updates(
    db: &DatabaseConnection,
    n: usize,
    workers: usize,
    batch: u32,
    form: Form,
    two_flights: bool,
) {
    db.execute_unprepared("UPDATE node SET score = 0")
        .await
        .expect("reset");
    // This machine's PostgreSQL runs without autovacuum: each run's updates would leave the
    // next run a more bloated `node` (the second of two runs measured up to a fifth slower).
    if db.get_database_backend() == sea_orm::DbBackend::Postgres {
        db.execute_unprepared("VACUUM node").await.expect("vacuum");
    }
    let rows = rows();
    fill(db, n, |i| {
        NewJob::new("bump", &((i % rows) as i32 + 1)).unwrap()
    })
    .await;
    let handlers = match form {
        Form::Leased => Jobs::new().handle_leased(
            "bump",
            RetryPolicy::default(),
            Duration::from_secs(30),
            |job: Job<i32>, _lease| async move { Ok(job.payload) },
            async |tx: &Tx, _job: Job<i32>, node: &i32| bump(tx, *node).await,
        ),
        Form::Update => Jobs::new().handle(
            "bump",
            RetryPolicy::default(),
            async |tx: &Tx, job: Job<i32>| bump(tx, job.payload).await,
        ),
        Form::Locked => Jobs::new().handle(
            "bump",
            RetryPolicy::default(),
            jobs::handler(move |tx, job: Job<i32>| {
                Box::pin(async move {
                    let nodes = tx.repository::<node::Entity>();
                    let found = nodes.load_locked(job.payload, ForUpdate::Wait).await?;
                    let found = found.ok_or_else(|| freshlock::ApplyError::msg("no such node"))?;
                    let mut model = (*found).clone().into_active_model();
                    model.score = Set(Some(found.score.unwrap_or(0) + 1));
                    match nodes.save(model).await? {
                        SaveOutcome::Updated(_) => Ok(()),
                        other => Err(freshlock::ApplyError::msg(format!("not saved: {other:?}"))),
                    }
                })
            }),
        ),
    };
    let (seconds, _) = drain(db, handlers, workers, batch, n, two_flights).await;
    let name = match form {
        Form::Update => "W2 one update each",
        Form::Locked => "W2 one locked update each",
        Form::Leased => "W2 one update each, leased (in the finish)",
    };
    let flights = if two_flights { ", two flights" } else { "" };
    row(&format!("{name}{flights}"), workers, batch, n, seconds);
    println!("  (on {rows} rows)");
    let sum = if db.get_database_backend() == sea_orm::DbBackend::MySql {
        "SELECT CAST(SUM(score) AS SIGNED) AS n FROM node"
    } else {
        "SELECT CAST(SUM(score) AS BIGINT) AS n FROM node"
    };
    let total: i64 = db
        .query_one_raw(Statement::from_string(db.get_database_backend(), sum))
        .await
        .expect("sum")
        .expect("a row")
        .try_get("", "n")
        .expect("a number");
    assert_eq!(
        total, n as i64,
        "every job's update is in the database exactly once"
    );
}

/// W3: the skewed workload, in the job's transaction or (`leased`) in the field report's
/// shape: claimed, worked outside any transaction, finished fenced; `two_flights`: on a session
/// with `two_flights(true)`.
async fn skewed(db: &DatabaseConnection, leased: bool, two_flights: bool) {
    const WORKERS: usize = 10;
    let n = scaled(2_000);
    // Even ids are the hot key's; odd ones spread over 50 keys.
    fill(db, n, |i| {
        let key = if i % 2 == 0 {
            "ham:hot".to_owned()
        } else {
            format!("ham:{}", (i / 2) % 50)
        };
        NewJob::new("work", &(i % 2 == 0)).unwrap().key(key)
    })
    .await;
    history(db).await;
    let running: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let overlaps = Arc::new(AtomicUsize::new(0));
    // When each job's work ended, from the start, by id (its commit follows within a round
    // trip); the last one stops the workers.
    let finished: Arc<Mutex<HashMap<i64, Duration>>> = Arc::default();
    // When each job's work started, by id: the hot key's gaps (one job's end to the next's
    // start) are what the queue costs its chain.
    let started: Arc<Mutex<HashMap<i64, Duration>>> = Arc::default();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let start = Instant::now();
    // One job's work, the same in both forms.
    let track = {
        let (running, overlaps) = (Arc::clone(&running), Arc::clone(&overlaps));
        let (finished, started) = (Arc::clone(&finished), Arc::clone(&started));
        move |id: i64, key: String| {
            let (running, overlaps) = (Arc::clone(&running), Arc::clone(&overlaps));
            let (finished, stop_tx) = (Arc::clone(&finished), stop_tx.clone());
            started.lock().unwrap().insert(id, start.elapsed());
            async move {
                {
                    let mut running = running.lock().unwrap();
                    let now = running.entry(key.clone()).or_default();
                    if *now > 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    *now += 1;
                }
                // 10 ms of work off the runtime: tokio's timer rounds a 10 ms sleep up to
                // about 11.2 ms here, which would move the floor.
                tokio::task::spawn_blocking(|| std::thread::sleep(Duration::from_millis(10)))
                    .await
                    .expect("the work");
                *running.lock().unwrap().get_mut(&key).unwrap() -= 1;
                let mut finished = finished.lock().unwrap();
                finished.insert(id, start.elapsed());
                if finished.len() == n {
                    let _ = stop_tx.send(true);
                }
            }
        }
    };
    let handlers = if leased {
        Jobs::new().handle_leased(
            "work",
            RetryPolicy::default(),
            Duration::from_secs(30),
            move |job: Job<bool>, _lease| {
                let work = track(job.id, job.key.unwrap_or_default());
                async move {
                    work.await;
                    Ok(())
                }
            },
            async |_tx: &Tx, _job: Job<bool>, _: &()| Ok(()),
        )
    } else {
        Jobs::new().handle(
            "work",
            RetryPolicy::default(),
            jobs::handler(move |_tx, job: Job<bool>| {
                let work = track(job.id, job.key.unwrap_or_default());
                Box::pin(async move {
                    work.await;
                    Ok(())
                })
            }),
        )
    };
    // The workers as an application runs them: `Worker::run` (woken by enqueues on
    // PostgreSQL, following a key whose next job it readied).
    let session = Session::builder(db.clone())
        .two_flights(two_flights)
        .build()
        .expect("session");
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let worker = Worker::new(session.clone(), handlers.clone());
            let mut stop = stop.clone();
            tokio::spawn(async move {
                worker
                    .run(async move {
                        let _ = stop.wait_for(|stop| *stop).await;
                    })
                    .await
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("worker").expect("the worker stopped");
    }
    // Every worker returned: the last chain's commit is in.
    let committed = start.elapsed().as_secs_f64();
    let finished = finished.lock().unwrap().clone();
    let seconds = (finished.values().max().copied().unwrap_or_default()).as_secs_f64();
    let hot: std::collections::HashSet<i64> = {
        let sql = "SELECT id FROM freshlock_job WHERE payload = 'true'";
        let rows = db
            .query_all_raw(Statement::from_string(db.get_database_backend(), sql))
            .await
            .expect("hot ids");
        rows.iter()
            .map(|r| r.try_get::<i64>("", "id").expect("id"))
            .collect()
    };
    let started = started.lock().unwrap().clone();
    let mut chain: Vec<i64> = hot.iter().copied().collect();
    chain.sort_unstable();
    let mut gaps: Vec<Duration> = (chain.windows(2))
        .map(|pair| started[&pair[1]].saturating_sub(finished[&pair[0]]))
        .collect();
    let mut others: Vec<Duration> = (finished.iter())
        .filter(|(id, _)| !hot.contains(id))
        .map(|(_, at)| *at)
        .collect();
    println!(
        "\nW3 {form}{flights} ({n} jobs of 10 ms, half on one key, {WORKERS} workers): wall {seconds:.2} s \
         to the last job's end, {committed:.2} s to its commit (the hot key's floor {:.1} s); \
         other keys' p50 {} ms, p99 {} ms; the hot key's gap \
         from one job's end to the next's start p50 {} ms, p99 {} ms; same-key overlaps {}; \
         worker time waiting on a lock: none (a busy key is skipped, never waited for)",
        hot.len() as f64 * 0.010,
        percentile_ms(&mut others, 50),
        percentile_ms(&mut others, 99),
        percentile_ms(&mut gaps, 50),
        percentile_ms(&mut gaps, 99),
        overlaps.load(Ordering::SeqCst),
        form = if leased {
            "leased"
        } else {
            "in the job's transaction"
        },
        flights = if two_flights { ", two flights" } else { "" },
    );
}
