//! Locks that hold across real OS processes: the test binary re-runs itself as a worker
//! (`worker_process`, ignored in normal runs) against a shared database.
//!
//! - 4 processes × 200 `locked_update` increments of one row → exactly 800, per backend and
//!   database (SQLite file, PostgreSQL, MariaDB).
//! - `kill -9` of a process holding a lease → another process gets the lock within TTL + 1 s.
//! - `SIGSTOP` of a holder past its TTL, another process writes, `SIGCONT` → the stale holder's
//!   write is refused (`LeaseLost`) and the newer value stays.

#[path = "common/servers.rs"]
mod servers;

use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdout, Command, Stdio},
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use entity::node;
use freshlock::lock::LockName;
use freshlock::lock::backend::{LeaseLock, LockGuard, LockRole};
use freshlock::{
    LockBackend, LockError, LockKind, LockPolicy, OnLockFailure, Session, UpdateOutcome,
};
use sea_orm::{ConnectionTrait, Set};
use servers::TestDb;

const ENV_MODE: &str = "FRESHLOCK_WORKER_MODE";

// ---------------------------------------------------------------- the worker (child side)

#[test]
#[ignore = "run by the cross-process tests as a child process"]
fn worker_process() {
    let Ok(mode) = std::env::var(ENV_MODE) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(worker(mode));
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

async fn worker(mode: String) {
    let url = env("FRESHLOCK_WORKER_URL");
    let schema = std::env::var("FRESHLOCK_WORKER_SCHEMA").ok();
    let kind: LockKind = env("FRESHLOCK_WORKER_LOCK").parse().unwrap();
    let db = servers::connect(&url, schema.as_deref(), 4).await;
    let redis = std::env::var("REDIS_URL")
        .ok()
        .map(|url| servers::redis_database(&url));
    let backend = kind.connect(&db, &url, redis.as_deref()).await.unwrap();
    let ttl = Duration::from_millis(env("FRESHLOCK_WORKER_TTL_MS").parse().unwrap());
    let policy = LockPolicy::default()
        .with_lock_tries(1)
        .with_wait_per_try(Duration::from_secs(60))
        .with_ttl(ttl)
        .with_on_failure(OnLockFailure::Fail);
    match mode.as_str() {
        "increment" => {
            let session = Session::builder(db)
                .lock(backend)
                .policy(policy)
                .build()
                .unwrap();
            let nodes = session.repository::<node::Entity>();
            let rounds: u32 = env("FRESHLOCK_WORKER_ROUNDS").parse().unwrap();
            for _ in 0..rounds {
                let report = nodes
                    .locked_update(1, |n| {
                        let score = n.score.as_ref().unwrap_or(0);
                        n.score = Set(Some(score + 1));
                        Ok(())
                    })
                    .await
                    .unwrap();
                assert!(report.outcome.is_updated());
                assert!(report.lock.held);
            }
            say("done");
        }
        "hold" => {
            let name = LockName::new("node:1").unwrap();
            let guard = backend
                .acquire(&name, Duration::from_secs(10), ttl)
                .await
                .unwrap();
            assert!(guard.is_some());
            say("held");
            std::future::pending::<()>().await;
        }
        "pause" => {
            let pausing = Arc::new(PauseAfterAcquire(backend));
            let session = Session::builder(db)
                .lock(pausing)
                .policy(policy)
                .build()
                .unwrap();
            let report = session
                .repository::<node::Entity>()
                .locked_update(1, |n| {
                    n.score = Set(Some(1));
                    Ok(())
                })
                .await
                .unwrap();
            let outcome = match report.outcome {
                UpdateOutcome::LeaseLost => "lease_lost",
                UpdateOutcome::Updated(_) => "updated",
                _ => "other",
            };
            say(&format!("outcome={outcome}"));
        }
        "claim_hold" | "claim_pause" => {
            let claims = freshlock::claim::Claims::new(db).with_label("worker");
            let task = LockName::new(env("FRESHLOCK_WORKER_TASK")).unwrap();
            let freshlock::claim::ClaimOutcome::Claimed(claim) =
                claims.claim(&task, ttl).await.unwrap()
            else {
                panic!("the task was free");
            };
            say("claimed");
            if mode == "claim_hold" {
                std::future::pending::<()>().await;
            }
            wait_for_go().await;
            let finished = claims.finish(&claim).await.unwrap();
            say(&format!("finish={finished:?}"));
        }
        "get_or_insert" => {
            let session = Session::builder(db)
                .lock(backend)
                .policy(policy)
                .build()
                .unwrap();
            say("ready");
            wait_for_go().await;
            let title = format!("by process {}", std::process::id());
            let got = session
                .repository::<node::Entity>()
                .get_or_insert(7, || node::ActiveModel {
                    title: Set(title.clone()),
                    ..node::ActiveModel::fresh(7)
                })
                .await
                .unwrap();
            let (created, row) = (got.is_created(), got.into_model());
            say(&format!("created={created};title={}", row.title));
        }
        "transfer" => {
            let session = Session::builder(db)
                .lock(backend)
                .policy(policy)
                .build()
                .unwrap();
            let accounts = session.repository::<entity::account::Entity>();
            let rounds: u32 = env("FRESHLOCK_WORKER_ROUNDS").parse().unwrap();
            let mut seed = u64::from(std::process::id()) | 1;
            let mut next = move |n: u64| {
                seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (seed >> 33) % n
            };
            let mut committed = 0;
            for _ in 0..rounds {
                let from = next(TRANSFER_ACCOUNTS as u64) as i32 + 1;
                let mut to = next(TRANSFER_ACCOUNTS as u64 - 1) as i32 + 1;
                if to >= from {
                    to += 1;
                }
                let amount = next(40) as i64 + 1;
                let call = accounts.locked_update_pair(from, to, move |a, b| {
                    let balance = *a.balance.as_ref();
                    if balance < amount {
                        return Err(freshlock::ApplyError::msg("insufficient funds"));
                    }
                    a.balance = Set(balance - amount);
                    b.balance = Set(*b.balance.as_ref() + amount);
                    Ok(())
                });
                match tokio::time::timeout(Duration::from_secs(60), call)
                    .await
                    .expect("no transfer hangs")
                {
                    Ok(report) => {
                        assert!(report.committed(), "{:?}", report.outcomes);
                        committed += 1;
                    }
                    Err(freshlock::Error::Apply { .. }) => {}
                    Err(error) => panic!("a transfer failed: {error} ({error:?})"),
                }
            }
            say(&format!("done:{committed}"));
        }
        other => panic!("unknown mode {other}"),
    }
}

/// Blocks (off the runtime) until the parent writes a line to our stdin.
async fn wait_for_go() {
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
    })
    .await
    .unwrap();
}

/// Tells the parent `what` (it reads `FRESHLOCK:` lines), at once.
fn say(what: &str) {
    println!("FRESHLOCK:{what}");
    std::io::stdout().flush().unwrap();
}

/// Says "acquired" and waits for a line on stdin before handing the lease to `locked_update`:
/// the parent stops this process right there.
#[derive(Debug)]
struct PauseAfterAcquire(Arc<dyn LockBackend>);

impl LockBackend for PauseAfterAcquire {
    fn queue(&self) -> Option<&dyn LockBackend> {
        self.0.queue()
    }

    fn kind(&self) -> freshlock::LockKind {
        self.0.kind()
    }

    fn role(&self) -> LockRole<'_> {
        LockRole::Lease(self)
    }
}

#[async_trait]
impl LeaseLock for PauseAfterAcquire {
    async fn acquire(
        &self,
        name: &LockName,
        wait: Duration,
        ttl: Duration,
    ) -> Result<Option<Box<dyn LockGuard>>, LockError> {
        let guard = self.0.acquire(name, wait, ttl).await?;
        say("acquired");
        wait_for_go().await;
        Ok(guard)
    }
}

// ---------------------------------------------------------------- the parent side

struct Worker {
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    fn spawn(mode: &str, db: &TestDb, lock: LockKind, ttl: Duration, rounds: u32) -> Worker {
        Self::spawn_env(mode, db, lock, ttl, rounds, None)
    }

    fn spawn_env(
        mode: &str,
        db: &TestDb,
        lock: LockKind,
        ttl: Duration,
        rounds: u32,
        task: Option<&str>,
    ) -> Worker {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args([
                "--exact",
                "worker_process",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_MODE, mode)
            .env("FRESHLOCK_WORKER_URL", &db.url)
            .env("FRESHLOCK_WORKER_LOCK", lock.as_str())
            .env("FRESHLOCK_WORKER_TTL_MS", ttl.as_millis().to_string())
            .env("FRESHLOCK_WORKER_ROUNDS", rounds.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(schema) = &db.schema {
            command.env("FRESHLOCK_WORKER_SCHEMA", schema);
        }
        if let Some(task) = task {
            command.env("FRESHLOCK_WORKER_TASK", task);
        }
        let mut child = command.spawn().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Worker { child, stdout }
    }

    fn spawn_task(mode: &str, db: &TestDb, lease: Duration, task: &str) -> Worker {
        Self::spawn_env(mode, db, LockKind::Local, lease, 0, Some(task))
    }

    /// The next `FRESHLOCK:` line the worker prints (blocking; run it off the runtime).
    fn expect_line(&mut self) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let read = self.stdout.read_line(&mut line).unwrap();
            assert!(read > 0, "worker ended without saying FRESHLOCK:…");
            // The harness may have printed "test worker_process ... " on the same line.
            if let Some((_, said)) = line.trim().split_once("FRESHLOCK:") {
                return said.to_owned();
            }
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    fn finish(mut self) {
        let status = self.child.wait().unwrap();
        assert!(status.success(), "worker failed: {status}");
    }
}

async fn line(worker: Worker) -> (Worker, String) {
    tokio::task::spawn_blocking(move || {
        let mut worker = worker;
        let said = worker.expect_line();
        (worker, said)
    })
    .await
    .unwrap()
}

async fn four_processes_increment(db: Option<TestDb>, lock: LockKind) {
    let Some(db) = db else { return };
    if lock == LockKind::Redis && servers::url(servers::REDIS).is_none() {
        return;
    }
    db.seed_nodes(1).await;
    let workers: Vec<Worker> = (0..4)
        .map(|_| Worker::spawn("increment", &db, lock, Duration::from_secs(30), 200))
        .collect();
    let mut finished = Vec::new();
    for worker in workers {
        let (worker, said) = line(worker).await;
        assert_eq!(said, "done");
        finished.push(worker);
    }
    for worker in finished {
        worker.finish();
    }
    assert_eq!(db.score(1).await, Some(800), "{lock} lost increments");
}

const TRANSFER_ACCOUNTS: i32 = 20;

/// 4 processes × 200 random transfers between 20 accounts of 100 (`locked_update_pair`, both
/// directions): the sum is exact, no balance is negative, no deadlock reaches a caller (the
/// worker fails on any error but "insufficient funds"), no call hangs.
async fn four_processes_transfer(db: Option<TestDb>, lock: LockKind) {
    use sea_orm::EntityTrait;
    let Some(db) = db else { return };
    if lock == LockKind::Redis && servers::url(servers::REDIS).is_none() {
        return;
    }
    let rows = (1..=TRANSFER_ACCOUNTS).map(|id| entity::account::ActiveModel {
        id: Set(id),
        balance: Set(100),
    });
    entity::account::Entity::insert_many(rows)
        .exec(&db.db)
        .await
        .unwrap();
    let workers: Vec<Worker> = (0..4)
        .map(|_| Worker::spawn("transfer", &db, lock, Duration::from_secs(30), 200))
        .collect();
    let mut committed = 0;
    let mut finished = Vec::new();
    for worker in workers {
        let (worker, said) = line(worker).await;
        let count = said.strip_prefix("done:").expect("done:N");
        committed += count.parse::<u32>().unwrap();
        finished.push(worker);
    }
    for worker in finished {
        worker.finish();
    }
    let accounts = entity::account::Entity::find().all(&db.db).await.unwrap();
    let sum: i64 = accounts.iter().map(|a| a.balance).sum();
    let lowest = accounts.iter().map(|a| a.balance).min().unwrap_or(0);
    eprintln!("{lock}: {committed} of 800 transfers committed; sum {sum}, lowest {lowest}");
    assert_eq!(
        sum,
        100 * i64::from(TRANSFER_ACCOUNTS),
        "{lock}: money made or lost"
    );
    assert!(lowest >= 0, "{lock}: a balance went negative");
    assert!(committed > 0);
}

/// Four processes ask for the same missing row at once: exactly one creates it, and all four
/// get the creator's row.
async fn four_processes_get_or_insert(db: Option<TestDb>, lock: LockKind) {
    let Some(db) = db else { return };
    if lock == LockKind::Redis && servers::url(servers::REDIS).is_none() {
        return;
    }
    let mut ready = Vec::new();
    for _ in 0..4 {
        let worker = Worker::spawn("get_or_insert", &db, lock, Duration::from_secs(30), 0);
        let (worker, said) = line(worker).await;
        assert_eq!(said, "ready");
        ready.push(worker);
    }
    for worker in &mut ready {
        writeln!(worker.child.stdin.as_mut().unwrap(), "go").unwrap();
    }
    let mut answers = Vec::new();
    for worker in ready {
        let (worker, said) = line(worker).await;
        answers.push(said);
        worker.finish();
    }
    let stored = db.db.query_one_raw(sea_orm::Statement::from_string(
        db.db.get_database_backend(),
        "SELECT title FROM node WHERE id = 7",
    ));
    let stored: String = stored.await.unwrap().unwrap().try_get("", "title").unwrap();
    let created = answers
        .iter()
        .filter(|a| a.starts_with("created=true"))
        .count();
    assert_eq!(created, 1, "{lock}: exactly one creator: {answers:?}");
    for answer in &answers {
        assert!(
            answer.ends_with(&format!(";title={stored}")),
            "{answer} vs {stored}"
        );
    }
}

async fn killed_holder_frees_the_lock(db: Option<TestDb>, lock: LockKind) {
    let Some(db) = db else { return };
    let redis = servers::url(servers::REDIS);
    if lock == LockKind::Redis && redis.is_none() {
        return;
    }
    let ttl = Duration::from_secs(2);
    let worker = Worker::spawn("hold", &db, lock, ttl, 0);
    let (mut worker, said) = line(worker).await;
    assert_eq!(said, "held");
    worker.child.kill().unwrap(); // SIGKILL
    worker.child.wait().unwrap();
    let backend = lock
        .connect(&db.db, &db.url, redis.as_deref())
        .await
        .unwrap();
    let name = LockName::new("node:1").unwrap();
    let taken = backend
        .acquire(&name, ttl + Duration::from_secs(1), ttl)
        .await
        .unwrap();
    assert!(
        taken.is_some(),
        "the dead holder's lock was not freed within TTL + 1 s"
    );
    taken.unwrap().release().await.unwrap();
}

async fn stopped_holder_is_fenced(db: Option<TestDb>, lock: LockKind) {
    let Some(db) = db else { return };
    let redis = servers::url(servers::REDIS);
    if lock == LockKind::Redis && redis.is_none() {
        return;
    }
    db.seed_nodes(1).await;
    let ttl = Duration::from_millis(500);
    let worker = Worker::spawn("pause", &db, lock, ttl, 0);
    let (mut worker, said) = line(worker).await;
    assert_eq!(said, "acquired");
    worker.signal("-STOP");

    // The newer holder: gets the lease once the stopped one's has expired, and writes.
    let backend = lock
        .connect(&db.db, &db.url, redis.as_deref())
        .await
        .unwrap();
    let policy = LockPolicy::default()
        .with_lock_tries(1)
        .with_wait_per_try(Duration::from_secs(10))
        .with_on_failure(OnLockFailure::Fail);
    let session = Session::builder(db.db.clone())
        .lock(backend)
        .policy(policy)
        .build()
        .unwrap();
    let report = session
        .repository::<node::Entity>()
        .locked_update(1, |n| {
            n.score = Set(Some(100));
            Ok(())
        })
        .await
        .unwrap();
    assert!(report.lock.held && report.outcome.is_updated());

    worker.signal("-CONT");
    writeln!(worker.child.stdin.as_mut().unwrap(), "go").unwrap();
    let (worker, said) = line(worker).await;
    assert_eq!(
        said, "outcome=lease_lost",
        "the stale holder's write was not refused"
    );
    worker.finish();
    assert_eq!(db.score(1).await, Some(100), "the newer value stays");
}

/// A worker killed (`kill -9`) after claiming: after the lease another worker claims and
/// finishes the task. A worker stopped past its lease and resumed: its late finish is refused.
async fn dead_and_late_claimants(db: Option<TestDb>, _lock: LockKind) {
    let Some(db) = db else { return };
    let claims = freshlock::claim::Claims::new(db.db.clone());
    let lease = Duration::from_millis(500);
    let claim_again = |task: LockName| {
        let claims = claims.clone();
        async move {
            let deadline = tokio::time::Instant::now() + lease + Duration::from_secs(1);
            loop {
                match claims.claim(&task, Duration::from_secs(60)).await.unwrap() {
                    freshlock::claim::ClaimOutcome::Claimed(claim) => break claim,
                    freshlock::claim::ClaimOutcome::Busy => {
                        assert!(
                            tokio::time::Instant::now() < deadline,
                            "not claimable within lease + 1 s"
                        );
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
    };

    // Killed after claiming.
    let worker = Worker::spawn_task("claim_hold", &db, lease, "spam-task:1");
    let (mut worker, said) = line(worker).await;
    assert_eq!(said, "claimed");
    worker.child.kill().unwrap();
    worker.child.wait().unwrap();
    let retry = claim_again(LockName::new("spam-task:1").unwrap()).await;
    assert_eq!(
        claims.finish(&retry).await.unwrap(),
        freshlock::claim::FinishOutcome::Finished
    );

    // Stopped past the lease, resumed after another worker took over and finished.
    let worker = Worker::spawn_task("claim_pause", &db, lease, "spam-task:2");
    let (mut worker, said) = line(worker).await;
    assert_eq!(said, "claimed");
    worker.signal("-STOP");
    let retry = claim_again(LockName::new("spam-task:2").unwrap()).await;
    assert_eq!(
        claims.finish(&retry).await.unwrap(),
        freshlock::claim::FinishOutcome::Finished
    );
    worker.signal("-CONT");
    writeln!(worker.child.stdin.as_mut().unwrap(), "go").unwrap();
    let (worker, said) = line(worker).await;
    assert_eq!(said, "finish=Stale", "the late finish is refused");
    worker.finish();
}

use servers::databases;

servers::server_tests! {
    increments_table_sqlite: four_processes_increment, LockKind::Table, sqlite;
    get_or_insert_table_sqlite: four_processes_get_or_insert, LockKind::Table, sqlite;
    get_or_insert_row_sqlite: four_processes_get_or_insert, LockKind::Row, sqlite;
    get_or_insert_local_sqlite: four_processes_get_or_insert, LockKind::Local, sqlite;
    get_or_insert_table_postgres: four_processes_get_or_insert, LockKind::Table, postgres;
    get_or_insert_row_postgres: four_processes_get_or_insert, LockKind::Row, postgres;
    get_or_insert_pg_advisory_postgres: four_processes_get_or_insert, LockKind::PgAdvisory, postgres;
    get_or_insert_local_postgres: four_processes_get_or_insert, LockKind::Local, postgres;
    get_or_insert_table_mysql: four_processes_get_or_insert, LockKind::Table, mysql;
    get_or_insert_row_mysql: four_processes_get_or_insert, LockKind::Row, mysql;
    get_or_insert_mysql_named_mysql: four_processes_get_or_insert, LockKind::MySqlNamed, mysql;
    get_or_insert_local_mysql: four_processes_get_or_insert, LockKind::Local, mysql;
    increments_row_sqlite: four_processes_increment, LockKind::Row, sqlite;
    increments_table_postgres: four_processes_increment, LockKind::Table, postgres;
    increments_row_postgres: four_processes_increment, LockKind::Row, postgres;
    increments_pg_advisory_postgres: four_processes_increment, LockKind::PgAdvisory, postgres;
    increments_table_mysql: four_processes_increment, LockKind::Table, mysql;
    increments_row_mysql: four_processes_increment, LockKind::Row, mysql;
    increments_mysql_named_mysql: four_processes_increment, LockKind::MySqlNamed, mysql;
    killed_table_sqlite: killed_holder_frees_the_lock, LockKind::Table, sqlite;
    killed_table_postgres: killed_holder_frees_the_lock, LockKind::Table, postgres;
    killed_table_mysql: killed_holder_frees_the_lock, LockKind::Table, mysql;
    killed_mysql_named_mysql: killed_holder_frees_the_lock, LockKind::MySqlNamed, mysql;
    stopped_table_sqlite: stopped_holder_is_fenced, LockKind::Table, sqlite;
    stopped_table_postgres: stopped_holder_is_fenced, LockKind::Table, postgres;
    stopped_table_mysql: stopped_holder_is_fenced, LockKind::Table, mysql;
    claimants_sqlite: dead_and_late_claimants, LockKind::Local, sqlite;
    claimants_postgres: dead_and_late_claimants, LockKind::Local, postgres;
    claimants_mysql: dead_and_late_claimants, LockKind::Local, mysql;
    transfers_table_sqlite: four_processes_transfer, LockKind::Table, sqlite;
    transfers_row_sqlite: four_processes_transfer, LockKind::Row, sqlite;
    transfers_table_postgres: four_processes_transfer, LockKind::Table, postgres;
    transfers_row_postgres: four_processes_transfer, LockKind::Row, postgres;
    transfers_pg_advisory_postgres: four_processes_transfer, LockKind::PgAdvisory, postgres;
    transfers_table_mysql: four_processes_transfer, LockKind::Table, mysql;
    transfers_row_mysql: four_processes_transfer, LockKind::Row, mysql;
    transfers_mysql_named_mysql: four_processes_transfer, LockKind::MySqlNamed, mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    increments_redis_postgres: four_processes_increment, LockKind::Redis, postgres;
    get_or_insert_redis_postgres: four_processes_get_or_insert, LockKind::Redis, postgres;
    increments_redis_mysql: four_processes_increment, LockKind::Redis, mysql;
    killed_redis_postgres: killed_holder_frees_the_lock, LockKind::Redis, postgres;
    stopped_redis_postgres: stopped_holder_is_fenced, LockKind::Redis, postgres;
    transfers_redis_postgres: four_processes_transfer, LockKind::Redis, postgres;
    transfers_redis_mysql: four_processes_transfer, LockKind::Redis, mysql;
}
