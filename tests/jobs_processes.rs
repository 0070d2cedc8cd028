//! Keyed jobs across real OS processes: worker processes killed with `-9` in the middle of a
//! job, on SQLite (a file), PostgreSQL and MariaDB. The test binary re-runs itself as a worker
//! (`job_worker_process`, ignored in normal runs).
//!
//! Three worker processes (batches of up to 4 jobs) run 60 jobs over 4 keys (and keyless ones). Every 15th job's handler
//! says so and hangs, after its write: the parent kills that process with `-9` and starts a
//! fresh one in its place. The killed job's transaction dies with its connection, so its write
//! is gone, and it runs again at once — its key is free again, the jobs behind it run. At the
//! end every job is done exactly once: the node scores add up to the job count. The workers
//! are stopped by closing their stdin, a graceful shutdown: each finishes its job and exits 0.
//!
//! The same with the kind leased (`Jobs::handle_leased`, a 1 s lease): every 15th job hangs in
//! its work (outside any transaction, its claim committed) or in its finish (after its write, in
//! the fenced transaction), alternately. A killed claim holds its key until its lease expires;
//! then another process reclaims the job and runs it again, and its finish's write is in the
//! database once.
//!
//! Duplicate enqueues across processes: four processes, released together, each enqueue the
//! same 40 unique jobs; exactly one of each is added (the others report `Duplicate`), and each
//! runs once.

#[macro_use]
#[path = "common/job_support.rs"]
mod job_support;
#[path = "common/servers.rs"]
mod servers;

use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdout, Command, Stdio},
    time::Duration,
};

use freshlock::{
    Session,
    jobs::{self, Job, Jobs, NewJob, RetryPolicy, Worker},
};
use job_support::bump;
use sea_orm::{ConnectionTrait, Statement};
use serde::{Deserialize, Serialize};
use servers::{TestDb, databases};

const ENV_URL: &str = "FRESHLOCK_JOB_WORKER_URL";
const ENV_SCHEMA: &str = "FRESHLOCK_JOB_WORKER_SCHEMA";
const ENV_MARKS: &str = "FRESHLOCK_JOB_WORKER_MARKS";
/// Set (to anything) for a worker whose kind is leased.
const ENV_LEASED: &str = "FRESHLOCK_JOB_WORKER_LEASED";
/// Set (to anything) for a worker that runs the periodic kind `tick`.
const ENV_PERIODIC: &str = "FRESHLOCK_JOB_WORKER_PERIODIC";
const JOBS: i32 = 60;
const HANG_EVERY: i32 = 15;
/// The unique jobs every enqueuer process enqueues.
const UNIQUE_JOBS: i32 = 40;
const ENQUEUERS: usize = 4;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Bump {
    node: i32,
    seq: i32,
}

// ---------------------------------------------------------------- the worker (child side)

#[test]
#[ignore = "run by the job process tests as a child process"]
fn job_worker_process() {
    let Ok(url) = std::env::var(ENV_URL) else {
        return;
    };
    let schema = std::env::var(ENV_SCHEMA).ok();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let db = servers::connect(&url, schema.as_deref(), 4).await;
        let handlers = if std::env::var(ENV_PERIODIC).is_ok() {
            periodic_handlers()
        } else if std::env::var(ENV_LEASED).is_ok() {
            leased_handlers()
        } else {
            Jobs::new().handle(
                "bump",
                RetryPolicy::default(),
                jobs::handler(|tx, job: Job<Bump>| {
                    Box::pin(async move {
                        bump(tx, job.payload.node).await?;
                        // A job that hangs the first time it runs, after its write: the parent
                        // kills this process right here.
                        if hangs(&job) {
                            hang(job.id).await;
                        }
                        Ok(())
                    })
                }),
            )
        };
        // Batches of up to 4: a killed process rolls back its whole batch, every job of which
        // runs again.
        let worker = Worker::new(Session::new(db), handlers).with_batch(4);
        say("ready");
        // Closing stdin is the graceful shutdown.
        let shutdown = async {
            tokio::task::spawn_blocking(|| {
                let mut line = String::new();
                while std::io::stdin().read_line(&mut line).unwrap_or(0) > 0 {
                    line.clear();
                }
            })
            .await
            .unwrap();
        };
        let ran = worker.run(shutdown).await.unwrap();
        say(&format!("stopped after {ran}"));
    });
}

/// The enqueuer: says `ready`, waits for a line on stdin, enqueues the 40 unique jobs of
/// [`duplicate_enqueues_across_processes`] (every other one in a transaction with a second
/// statement), then says how many it added and how many were duplicates.
#[test]
#[ignore = "run by the job process tests as a child process"]
fn job_enqueuer_process() {
    let Ok(url) = std::env::var(ENV_URL) else {
        return;
    };
    let schema = std::env::var(ENV_SCHEMA).ok();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        use sea_orm::TransactionTrait;
        let db = servers::connect(&url, schema.as_deref(), 2).await;
        say("ready");
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        let (mut added, mut duplicates) = (0, 0);
        for seq in 0..UNIQUE_JOBS {
            let job = NewJob::new(
                "bump",
                &Bump {
                    node: seq % 5 + 1,
                    seq,
                },
            )
            .unwrap()
            .key(format!("node:{}", seq % 4))
            .unique(format!("spam:{seq}"));
            let txn = db.begin().await.unwrap();
            let enqueued = jobs::enqueue(&txn, job).await.unwrap();
            if seq % 2 == 0 {
                // The caller's own work after the enqueue, in its transaction.
                txn.execute_unprepared("SELECT 1").await.unwrap();
            }
            txn.commit().await.unwrap();
            match enqueued {
                jobs::Enqueued::Added(_) => added += 1,
                jobs::Enqueued::Duplicate { .. } => duplicates += 1,
                other => panic!("{other:?}"),
            }
        }
        say(&format!("enqueued {added} {duplicates}"));
    });
}

/// The kind leased: every 15th job hangs once, in its work (the claim committed, no
/// transaction open) or in its finish (after its write), alternately.
fn leased_handlers() -> Jobs {
    Jobs::new().handle_leased(
        "bump",
        RetryPolicy::default(),
        Duration::from_secs(1),
        |job: Job<Bump>, _lease| async move {
            let in_work = job.payload.seq / HANG_EVERY % 2 == 0;
            if in_work && hangs(&job) {
                hang(job.id).await;
            }
            Ok::<_, freshlock::ApplyError>(())
        },
        async |tx: &freshlock::Tx, job: Job<Bump>, _: &()| {
            bump(tx, job.payload.node).await?;
            let in_finish = job.payload.seq / HANG_EVERY % 2 == 1;
            if in_finish && hangs(&job) {
                hang(job.id).await;
            }
            Ok(())
        },
    )
}

/// `tick` every second, missed slots caught up: each run bumps node 1.
fn periodic_handlers() -> Jobs {
    let every_second = jobs::Periodic::new("tick", "* * * * * *")
        .unwrap()
        .missed(jobs::Missed::CatchUp);
    Jobs::new()
        .handle(
            "tick",
            RetryPolicy::default(),
            async |tx: &freshlock::Tx, _job: Job<()>| {
                bump(tx, 1).await?;
                Ok(())
            },
        )
        .periodic(every_second)
}

/// Whether `job` is one that hangs (every 15th), on the first run that reaches this point.
fn hangs(job: &Job<Bump>) -> bool {
    job.payload.seq % HANG_EVERY == HANG_EVERY - 1 && !already_hung(job.id)
}

/// Says so and hangs: the parent kills this process here.
async fn hang(id: i64) {
    say(&format!("hanging {id}"));
    std::future::pending::<()>().await;
}

/// Whether job `id` hung in an earlier process: a killed process's writes rolled back, so the
/// mark is a file (in the directory the parent names), made outside any transaction.
fn already_hung(id: i64) -> bool {
    let dir = std::env::var(ENV_MARKS).unwrap();
    let mark = std::path::Path::new(&dir).join(format!("hung-{id}"));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(mark)
        .is_err()
}

/// Tells the parent `what` (it reads `FRESHLOCK:` lines), at once.
fn say(what: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "FRESHLOCK:{what}").unwrap();
    out.flush().unwrap();
}

// ---------------------------------------------------------------- the parent side

struct Process {
    child: Child,
    /// Lines the child says, read off the runtime.
    said: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Process {
    fn spawn(
        db: &TestDb,
        marks: &std::path::Path,
        leased: bool,
        tag: usize,
        events: tokio::sync::mpsc::UnboundedSender<(usize, String)>,
    ) -> Self {
        Self::spawn_as("job_worker_process", db, marks, leased, tag, events)
    }

    /// A child process running the ignored test `role`.
    fn spawn_as(
        role: &str,
        db: &TestDb,
        marks: &std::path::Path,
        leased: bool,
        tag: usize,
        events: tokio::sync::mpsc::UnboundedSender<(usize, String)>,
    ) -> Self {
        let mut command = Command::new(std::env::current_exe().unwrap());
        let test = if role == "periodic" {
            "job_worker_process"
        } else {
            role
        };
        command
            .args([
                "--exact",
                test,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_URL, &db.url)
            .env(ENV_MARKS, marks)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(schema) = &db.schema {
            command.env(ENV_SCHEMA, schema);
        }
        match role {
            _ if leased => {
                command.env(ENV_LEASED, "1");
            }
            "periodic" => {
                command.env(ENV_PERIODIC, "1");
            }
            _ => {}
        }
        let mut child = command.spawn().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, said) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || read_lines(stdout, tag, &tx, &events));
        Self { child, said }
    }

    fn kill(mut self) {
        let status = Command::new("kill")
            .args(["-9", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let _ = self.child.wait();
    }

    /// Writes `line` to the child's stdin.
    fn tell(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Closes stdin (the graceful shutdown) and waits for a clean exit.
    async fn stop(mut self) -> String {
        drop(self.child.stdin.take());
        let mut last = String::new();
        while let Some(line) = self.said.recv().await {
            last = line;
        }
        let status = tokio::task::spawn_blocking(move || self.child.wait().unwrap())
            .await
            .unwrap();
        assert!(status.success(), "worker failed: {status}");
        last
    }
}

fn read_lines(
    stdout: BufReader<ChildStdout>,
    tag: usize,
    said: &tokio::sync::mpsc::UnboundedSender<String>,
    events: &tokio::sync::mpsc::UnboundedSender<(usize, String)>,
) {
    for line in stdout.lines() {
        let Ok(line) = line else { return };
        // The harness may have printed "test job_worker_process ... " on the same line.
        if let Some((_, what)) = line.split_once("FRESHLOCK:") {
            let _ = said.send(what.to_owned());
            let _ = events.send((tag, what.to_owned()));
        }
    }
}

async fn number(db: &TestDb, sql: &str) -> i64 {
    let row = db
        .db
        .query_one_raw(Statement::from_string(db.db.get_database_backend(), sql))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<Option<i64>>(0).unwrap().unwrap_or(0)
}

async fn killed_workers_never_lose_or_double_a_job(db: Option<TestDb>) {
    killed_workers(db, false).await;
}

async fn killed_leased_workers_never_lose_or_double_a_job(db: Option<TestDb>) {
    killed_workers(db, true).await;
}

async fn killed_workers(db: Option<TestDb>, leased: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(5).await;
    let marks = std::env::temp_dir().join(servers::unique("job-marks"));
    std::fs::create_dir_all(&marks).unwrap();
    for seq in 0..JOBS {
        let node = seq % 5 + 1;
        let job = NewJob::new("bump", &Bump { node, seq }).unwrap();
        // Nodes 1–4 are keys; node 5's jobs have none.
        let job = if node < 5 {
            job.key(format!("node:{node}"))
        } else {
            job
        };
        jobs::enqueue(&db.db, job).await.unwrap();
    }
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let mut processes: Vec<Option<Process>> = (0..3)
        .map(|tag| Some(Process::spawn(&db, &marks, leased, tag, events_tx.clone())))
        .collect();
    let done_sql = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    let mut killed = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while number(&db, done_sql).await < i64::from(JOBS) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the jobs did not finish"
        );
        let event = tokio::time::timeout(Duration::from_millis(200), events.recv()).await;
        let Ok(Some((tag, what))) = event else {
            continue;
        };
        // A process runs a batch's leased works side by side: two of them may hang in it, and
        // the second says so after the process was already killed for the first (or never).
        if what.starts_with("hanging")
            && let Some(process) = processes[tag].take()
        {
            process.kill();
            killed += 1;
            let tag = processes.len();
            let process = Process::spawn(&db, &marks, leased, tag, events_tx.clone());
            processes.push(Some(process));
        }
    }
    for process in processes.into_iter().flatten() {
        let last = process.stop().await;
        assert!(last.starts_with("stopped after"), "{last}");
    }
    let backend = db.db.get_database_backend();
    let sum = if backend == sea_orm::DbBackend::MySql {
        "SELECT CAST(SUM(score) AS SIGNED) FROM node"
    } else {
        "SELECT CAST(SUM(score) AS BIGINT) FROM node"
    };
    eprintln!("{backend:?} (leased: {leased}): {killed} worker processes killed mid-job");
    let hung = std::fs::read_dir(&marks).unwrap().count();
    assert_eq!(
        hung,
        (JOBS / HANG_EVERY) as usize,
        "every 15th job hung once"
    );
    assert!(
        killed >= 1 && killed <= hung,
        "{killed} killed for {hung} hung"
    );
    assert_eq!(number(&db, done_sql).await, i64::from(JOBS));
    assert_eq!(
        number(&db, sum).await,
        i64::from(JOBS),
        "every job's effect is in the database exactly once"
    );
    let _ = std::fs::remove_dir_all(&marks);
}

/// Four processes enqueue the same 40 unique jobs at once: each unique key is added once (one
/// process gets `Added`, the three others `Duplicate`), the table holds 40 jobs, and running them
/// bumps the nodes 40 times.
async fn duplicate_enqueues_across_processes(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(5).await;
    let marks = std::env::temp_dir();
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let mut enqueuers: Vec<Process> = (0..ENQUEUERS)
        .map(|tag| {
            let events = events_tx.clone();
            Process::spawn_as("job_enqueuer_process", &db, &marks, false, tag, events)
        })
        .collect();
    // Released together, once every one has connected.
    let mut ready = 0;
    while ready < ENQUEUERS {
        let (_, what) = events.recv().await.unwrap();
        ready += usize::from(what == "ready");
    }
    for enqueuer in &mut enqueuers {
        enqueuer.tell("go");
    }
    let (mut added, mut duplicates) = (0, 0);
    for enqueuer in enqueuers {
        let last = enqueuer.stop().await;
        let counts: Vec<i32> = (last.strip_prefix("enqueued ").unwrap().split(' '))
            .map(|n| n.parse().unwrap())
            .collect();
        added += counts[0];
        duplicates += counts[1];
    }
    assert_eq!(added, UNIQUE_JOBS, "each unique job added once");
    assert_eq!(duplicates, UNIQUE_JOBS * (ENQUEUERS as i32 - 1));
    let jobs_sql = "SELECT COUNT(*) FROM freshlock_job";
    assert_eq!(number(&db, jobs_sql).await, i64::from(UNIQUE_JOBS));
    let distinct = "SELECT COUNT(DISTINCT unique_key) FROM freshlock_job";
    assert_eq!(number(&db, distinct).await, i64::from(UNIQUE_JOBS));
    let handlers = Jobs::new().handle(
        "bump",
        RetryPolicy::default(),
        jobs::handler(|tx, job: Job<Bump>| {
            Box::pin(async move {
                bump(tx, job.payload.node).await?;
                Ok(())
            })
        }),
    );
    let runs = Worker::new(Session::new(db.db.clone()), handlers)
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(runs.len(), UNIQUE_JOBS as usize);
    let backend = db.db.get_database_backend();
    let sum = if backend == sea_orm::DbBackend::MySql {
        "SELECT CAST(SUM(score) AS SIGNED) FROM node"
    } else {
        "SELECT CAST(SUM(score) AS BIGINT) FROM node"
    };
    assert_eq!(
        number(&db, sum).await,
        i64::from(UNIQUE_JOBS),
        "every unique job's effect is in the database exactly once"
    );
}

/// Three worker processes race for the slots of `tick` (every second, missed slots caught up):
/// each slot is enqueued once and runs once. Then all three are killed with `-9`, slots pass
/// with no worker, and three fresh processes catch up on them: still each slot once, none
/// missing — the slot table survives the restart.
async fn periodic_slots_run_once_across_processes_and_restarts(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let marks = std::env::temp_dir();
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let spawn = |tag| Process::spawn_as("periodic", &db, &marks, false, tag, events_tx.clone());
    let done_sql = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    // Waits (polling the database, at most a minute) until at least `n` ticks are done.
    let until_done = async |n: i64| {
        for _ in 0..600 {
            if number(&db, done_sql).await >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("fewer than {n} ticks done in a minute");
    };
    let first: Vec<Process> = (0..3).map(spawn).collect();
    let mut ready = 0;
    while ready < 3 {
        ready += usize::from(events.recv().await.unwrap().1 == "ready");
    }
    until_done(3).await;
    for process in first {
        process.kill();
    }
    let before = number(&db, done_sql).await;
    // Slots pass with no worker running.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second: Vec<Process> = (3..6).map(spawn).collect();
    until_done(before + 4).await;
    for process in second {
        process.stop().await;
    }
    // Every tick enqueued is a distinct slot, and the slots are consecutive seconds.
    let backend = db.db.get_database_backend();
    let sql = "SELECT unique_key, state FROM freshlock_job ORDER BY id";
    let rows = (db.db)
        .query_all_raw(Statement::from_string(backend, sql))
        .await
        .unwrap();
    let mut slots: Vec<i64> = Vec::new();
    let mut done = 0;
    for row in &rows {
        let key: Vec<u8> = row.try_get("", "unique_key").unwrap();
        let key = String::from_utf8(key).unwrap();
        let slot = key.rsplit(':').next().unwrap().parse::<i64>().unwrap();
        slots.push(slot);
        let state: i16 = row.try_get("", "state").unwrap();
        done += i64::from(state == 2);
    }
    let mut distinct = slots.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        slots.len(),
        "a slot enqueued twice: {slots:?}"
    );
    assert!(
        distinct.windows(2).all(|w| w[1] - w[0] == 1_000),
        "a slot missing: {distinct:?}"
    );
    let sum = if backend == sea_orm::DbBackend::MySql {
        "SELECT CAST(SUM(score) AS SIGNED) FROM node"
    } else {
        "SELECT CAST(SUM(score) AS BIGINT) FROM node"
    };
    assert_eq!(number(&db, sum).await, done, "each done tick's write once");
}

on_databases! {
    periodic_across_processes_sqlite: periodic_slots_run_once_across_processes_and_restarts, sqlite;
    periodic_across_processes_postgres: periodic_slots_run_once_across_processes_and_restarts, postgres;
    periodic_across_processes_mysql: periodic_slots_run_once_across_processes_and_restarts, mysql;
}

on_databases! {
    duplicate_enqueues_sqlite: duplicate_enqueues_across_processes, sqlite;
    duplicate_enqueues_postgres: duplicate_enqueues_across_processes, postgres;
    duplicate_enqueues_mysql: duplicate_enqueues_across_processes, mysql;
}

on_databases! {
    killed_job_workers_sqlite: killed_workers_never_lose_or_double_a_job, sqlite;
    killed_job_workers_postgres: killed_workers_never_lose_or_double_a_job, postgres;
    killed_job_workers_mysql: killed_workers_never_lose_or_double_a_job, mysql;
    killed_leased_job_workers_sqlite: killed_leased_workers_never_lose_or_double_a_job, sqlite;
    killed_leased_job_workers_postgres: killed_leased_workers_never_lose_or_double_a_job, postgres;
    killed_leased_job_workers_mysql: killed_leased_workers_never_lose_or_double_a_job, mysql;
}
