//! A crash-restart of PostgreSQL, as the Linux OOM killer makes one: `kill -9` of one client
//! backend of a private server (never the shared one). The postmaster then terminates *every*
//! session, discards shared memory (WAL not yet written included) and recovers while it accepts
//! connections again; a transaction id that never reached the WAL is handed out again. MariaDB
//! has no such per-session crash (`KILL CONNECTION` ends one session cleanly): its form is a
//! `kill -9` of `mariadbd` itself, started again at once (InnoDB crash recovery).
//!
//! Worker OS processes (this test binary re-run as `backend_kill_worker`) increment rows with
//! `locked_update` while the parent kills a random client backend several times. Each worker
//! counts its acknowledged and unknown calls per row and the moments of its successes; the
//! parent then checks every row: acknowledged ≤ counter ≤ acknowledged + unknown (nothing lost,
//! nothing applied twice), and that some call succeeded within 2 s of the server accepting
//! connections again after every reset.
//!
//! The same with each write in two flights (`SessionBuilder::two_flights`): on PostgreSQL the
//! transaction id its reload read is the evidence a lost reply is resolved with, and an id handed
//! out again after the crash must not read as this write's commit.
//!
//! `FRESHLOCK_SOAK_RESETS=N` runs N resets per test instead of the short form's (see
//! `.ci/soak-backend-kill`).

#[path = "common/private_mariadb.rs"]
mod private_mariadb;
#[path = "common/private_pg.rs"]
mod private_pg;
#[path = "common/servers.rs"]
mod servers;

use std::{
    io::{BufRead, BufReader, Read},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use entity::node;
use freshlock::{Error, LockKind, Session};
use migration::{Migrator, MigratorTrait};
use private_mariadb::PrivateMariaDb;
use private_pg::PrivatePostgres;
use sea_orm::{ConnectOptions, Database, EntityTrait, Set};

const ENV_WORKER: &str = "FRESHLOCK_KILL_WORKER";

/// One run's shape.
#[derive(Clone, Copy, Debug)]
struct Run {
    /// MariaDB (`kill -9` of the server) instead of PostgreSQL (`kill -9` of one backend).
    mariadb: bool,
    kind: LockKind,
    processes: u32,
    tasks: u32,
    rows: u32,
    combine: bool,
    optimistic: bool,
    /// Each `locked_update` in two flights (`SessionBuilder::two_flights`).
    two_flights: bool,
    resets: u32,
}

impl Run {
    const fn new(kind: LockKind) -> Self {
        Self {
            mariadb: false,
            kind,
            processes: 2,
            tasks: 4,
            rows: 1,
            combine: false,
            optimistic: false,
            two_flights: false,
            resets: 6,
        }
    }

    const fn mariadb(kind: LockKind) -> Self {
        Self {
            mariadb: true,
            ..Self::new(kind)
        }
    }
}

/// At most two runs at a time: each has a server and two worker processes, on 2 cores.
static RUNNING: (Mutex<u32>, Condvar) = (Mutex::new(0), Condvar::new());

/// A place among the runs allowed at once, given back on drop.
struct Slot;

impl Slot {
    fn take() -> Self {
        let (count, freed) = &RUNNING;
        let mut running = count.lock().unwrap();
        while *running >= 2 {
            running = freed.wait(running).unwrap();
        }
        *running += 1;
        Self
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let (count, freed) = &RUNNING;
        *count.lock().unwrap() -= 1;
        freed.notify_one();
    }
}

/// The private server a run crashes.
enum Server {
    Postgres(PrivatePostgres),
    MariaDb(PrivateMariaDb),
}

impl Server {
    fn start(mariadb: bool) -> Self {
        if mariadb {
            Self::MariaDb(PrivateMariaDb::start())
        } else {
            Self::Postgres(PrivatePostgres::start())
        }
    }

    fn url(&self) -> String {
        match self {
            Self::Postgres(server) => server.url(),
            Self::MariaDb(server) => server.url(),
        }
    }

    /// Crashes the server (see the module docs) and returns the moment (epoch ms) it accepts
    /// connections again; `None` when no crash could be made this time.
    fn reset(&self, rng: &mut fastrand::Rng) -> Option<u64> {
        match self {
            Self::Postgres(server) => reset(server, rng),
            Self::MariaDb(server) => {
                server.kill9_and_restart();
                Some(now_ms())
            }
        }
    }

    /// How many crash-restarts the server's own log shows (PostgreSQL), or were made (MariaDB,
    /// whose process this test kills itself).
    fn crashes(&self, made: usize) -> usize {
        match self {
            Self::Postgres(server) => {
                let log = std::fs::read_to_string(server.dir.join("log")).unwrap_or_default();
                log.matches("all server processes terminated; reinitializing")
                    .count()
            }
            Self::MariaDb(_) => made,
        }
    }
}

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

// ------------------------------------------------------------------ the worker (child side)

#[test]
#[ignore = "run by the backend-kill tests as a child process"]
fn backend_kill_worker() {
    if std::env::var_os(ENV_WORKER).is_none() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(worker());
}

fn env<T: std::str::FromStr>(name: &str) -> T {
    let value = std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"));
    value
        .parse()
        .unwrap_or_else(|_| panic!("{name}: {value:?} does not parse"))
}

#[derive(Default)]
struct Counts {
    acknowledged: Vec<u64>,
    unknown: Vec<u64>,
    failed: u64,
    successes: Vec<u64>,
}

async fn worker() {
    let url: String = env("FL_URL");
    let kind: LockKind = env("FL_LOCK");
    let (tasks, rows): (u32, u32) = (env("FL_TASKS"), env("FL_ROWS"));
    let (combine, optimistic): (bool, bool) = (env("FL_COMBINE"), env("FL_OPTIMISTIC"));
    let two_flights: bool = env("FL_TWO_FLIGHTS");
    let db = servers::crashable_pool(&url, tasks + 2).await;
    let redis = std::env::var(servers::REDIS).ok();
    let backend = kind.connect(&db, &url, redis.as_deref()).await.unwrap();

    // The parent closes our stdin to stop us.
    let stop = Arc::new(AtomicBool::new(false));
    let stopper = Arc::clone(&stop);
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        stopper.store(true, Ordering::SeqCst);
    });

    let counts = Arc::new(Mutex::new(Counts {
        acknowledged: vec![0; rows as usize],
        unknown: vec![0; rows as usize],
        ..Counts::default()
    }));
    let workers: Vec<_> = (0..tasks)
        .map(|task| {
            let mut builder = Session::builder(db.clone())
                .lock(Arc::clone(&backend))
                .policy(servers::crash_policy())
                .combine_commits(combine)
                .optimistic_first(optimistic)
                .two_flights(two_flights);
            if optimistic {
                builder = builder.version_column::<node::Entity>(node::Column::Changed);
            }
            let session = builder.build().unwrap();
            let (stop, counts) = (Arc::clone(&stop), Arc::clone(&counts));
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                let mut rng = fastrand::Rng::with_seed(u64::from(task));
                while !stop.load(Ordering::SeqCst) {
                    let row = rng.u32(0..rows);
                    let call = nodes.locked_update(i32::try_from(row).unwrap() + 1, |n| {
                        let score = n.score.as_ref().unwrap_or(0);
                        n.score = Set(Some(score + 1));
                        Ok(())
                    });
                    let result = tokio::time::timeout(Duration::from_secs(90), call)
                        .await
                        .expect("no call hangs");
                    let failed = {
                        let mut counts = counts.lock().unwrap();
                        match result {
                            Ok(report) if report.outcome.is_updated() => {
                                counts.acknowledged[row as usize] += 1;
                                counts.successes.push(now_ms());
                                false
                            }
                            // `LeaseLost` (`mysql_named`: the crash ended the lock's session
                            // and another process moved the fence): nothing written, reported.
                            Ok(_) => {
                                counts.failed += 1;
                                true
                            }
                            Err(Error::CommitUnknown { .. }) => {
                                counts.unknown[row as usize] += 1;
                                false
                            }
                            Err(_) => {
                                counts.failed += 1;
                                true
                            }
                        }
                    };
                    if failed {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect();
    for task in workers {
        task.await.unwrap();
    }
    let counts = counts.lock().unwrap();
    let list = |values: &[u64]| {
        values
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    println!(
        "FRESHLOCK:{};{};{};{}",
        list(&counts.acknowledged),
        list(&counts.unknown),
        counts.failed,
        list(&counts.successes)
    );
}

// ------------------------------------------------------------------ the parent

struct Worker {
    child: Child,
}

impl Worker {
    fn spawn(url: &str, run: Run) -> Self {
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "backend_kill_worker",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_WORKER, "1")
            .env("FL_URL", url)
            .env("FL_LOCK", run.kind.as_str())
            .env("FL_TASKS", run.tasks.to_string())
            .env("FL_ROWS", run.rows.to_string())
            .env("FL_COMBINE", run.combine.to_string())
            .env("FL_OPTIMISTIC", run.optimistic.to_string())
            .env("FL_TWO_FLIGHTS", run.two_flights.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        Self { child }
    }

    /// Stops the worker (closes its stdin) and reads its counts.
    fn finish(mut self) -> Counts {
        drop(self.child.stdin.take());
        let stdout = BufReader::new(self.child.stdout.take().unwrap());
        // Read to the end: the test harness still prints its summary after our line.
        let lines: Vec<String> = stdout.lines().map(Result::unwrap).collect();
        let said = lines
            .iter()
            .find_map(|line| {
                line.split_once("FRESHLOCK:")
                    .map(|(_, said)| said.to_owned())
            })
            .expect("the worker reports its counts");
        assert!(self.child.wait().unwrap().success(), "the worker failed");
        let parts: Vec<&str> = said.split(';').collect();
        let list = |part: &str| -> Vec<u64> {
            part.split(',')
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().unwrap())
                .collect()
        };
        Counts {
            acknowledged: list(parts[0]),
            unknown: list(parts[1]),
            failed: parts[2].parse().unwrap(),
            successes: list(parts[3]),
        }
    }
}

/// `kill -9` of one random client backend of `server` (not the asking session's), then waits
/// until the server has reset and accepts connections again; returns that moment (epoch ms).
fn reset(server: &PrivatePostgres, rng: &mut fastrand::Rng) -> Option<u64> {
    let listed = Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &server.port.to_string(),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-tAc",
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend' \
             AND pid <> pg_backend_pid()",
        ])
        .output()
        .unwrap();
    let pids: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(str::trim)
        .filter(|pid| !pid.is_empty())
        .map(str::to_owned)
        .collect();
    if pids.is_empty() {
        return None; // Nobody connected right now (reconnecting): try again later.
    }
    let pid = &pids[rng.usize(0..pids.len())];
    let killed = Command::new("kill").args(["-9", pid]).status().unwrap();
    if !killed.success() {
        return None; // It ended by itself meanwhile.
    }
    // The postmaster notices at once and refuses connections while it recovers; a reset so
    // quick that no poll sees it refused is still a reset.
    let deadline = Instant::now() + Duration::from_secs(3);
    while server.accepting() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !server.accepting() {
        assert!(Instant::now() < deadline, "the server did not recover");
        std::thread::sleep(Duration::from_millis(2));
    }
    Some(now_ms())
}

/// The sum of the rows' counters, read on a connection of its own (the server may be resetting:
/// `None` then).
async fn total(url: &str) -> Option<i64> {
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(1)
        .connect_timeout(Duration::from_secs(2))
        .sqlx_logging(false);
    let db = Database::connect(options).await.ok()?;
    let rows = node::Entity::find().all(&db).await.ok()?;
    db.close().await.ok()?;
    Some(rows.iter().map(|n| i64::from(n.score.unwrap_or(0))).sum())
}

/// Waits (bounded) until the rows gained at least `more` increments since `since`.
async fn progress(url: &str, since: i64, more: i64) -> i64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(now) = total(url).await
            && now >= since + more
        {
            return now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no progress: the workers stalled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn survives_resets(mut run: Run) {
    // The private-server tier runs where the server tier runs.
    if servers::url(if run.mariadb {
        servers::MYSQL
    } else {
        servers::POSTGRES
    })
    .is_none()
    {
        return;
    }
    if run.kind == LockKind::Redis && servers::url(servers::REDIS).is_none() {
        return;
    }
    let _slot = tokio::task::spawn_blocking(Slot::take).await.unwrap();
    if let Some(resets) = std::env::var("FRESHLOCK_SOAK_RESETS")
        .ok()
        .and_then(|n| n.parse().ok())
    {
        run.resets = resets;
    }
    let mariadb = run.mariadb;
    let server = tokio::task::spawn_blocking(move || Server::start(mariadb))
        .await
        .unwrap();
    let url = server.url();
    let db = servers::crashable_pool(&url, 2).await;
    Migrator::up(&db, None).await.unwrap();
    for id in 1..=run.rows {
        node::Entity::insert(node::ActiveModel::fresh(i32::try_from(id).unwrap()))
            .exec(&db)
            .await
            .unwrap();
    }
    drop(db);

    let workers: Vec<Worker> = (0..run.processes)
        .map(|_| Worker::spawn(&url, run))
        .collect();
    let mut seen = progress(&url, 0, 50).await;
    let server = Arc::new(server);
    let mut readies = Vec::new();
    let mut rng = fastrand::Rng::with_seed(u64::from(run.resets) ^ now_ms());
    while readies.len() < run.resets as usize {
        // A random moment within the workers' stream of calls.
        tokio::time::sleep(Duration::from_millis(rng.u64(50..400))).await;
        let (killer, seed) = (Arc::clone(&server), rng.u64(..));
        let ready =
            tokio::task::spawn_blocking(move || killer.reset(&mut fastrand::Rng::with_seed(seed)))
                .await
                .unwrap();
        if let Some(ready) = ready {
            readies.push(ready);
        }
        seen = progress(&url, seen, 20).await;
    }
    let counts: Vec<Counts> =
        tokio::task::spawn_blocking(move || workers.into_iter().map(Worker::finish).collect())
            .await
            .unwrap();

    let db = servers::crashable_pool(&url, 1).await;
    let stored = node::Entity::find().all(&db).await.unwrap();
    let mut lost_or_doubled = Vec::new();
    let (mut acknowledged, mut unknown) = (0, 0);
    for row in &stored {
        let index = usize::try_from(row.id - 1).unwrap();
        let acked: u64 = counts.iter().map(|c| c.acknowledged[index]).sum();
        let doubt: u64 = counts.iter().map(|c| c.unknown[index]).sum();
        let counter = u64::try_from(row.score.unwrap_or(0)).unwrap();
        (acknowledged, unknown) = (acknowledged + acked, unknown + doubt);
        if counter < acked || counter > acked + doubt {
            lost_or_doubled.push((row.id, acked, doubt, counter));
        }
    }
    // Every kill was a crash-restart, not one session ended: the postmaster says so in its log.
    let reinitialized = server.crashes(readies.len());
    assert!(
        reinitialized >= readies.len(),
        "{run:?}: {} kills but {reinitialized} crash-restarts in the server's log",
        readies.len()
    );
    let failed: u64 = counts.iter().map(|c| c.failed).sum();
    let mut successes: Vec<u64> = counts.iter().flat_map(|c| c.successes.clone()).collect();
    successes.sort_unstable();
    let recoveries: Vec<u64> = readies
        .iter()
        .map(|&ready| {
            let at = successes.partition_point(|&s| s < ready);
            successes.get(at).map_or(u64::MAX, |first| first - ready)
        })
        .collect();
    let slowest = recoveries.iter().copied().max().unwrap_or(0);
    eprintln!(
        "backend kill {run:?}: {} resets ({reinitialized} in the log), {acknowledged} acknowledged, {unknown} unknown, \
         {failed} reported failures, rows lost or doubled {lost_or_doubled:?}; recovery after \
         each reset (ms) {recoveries:?}",
        readies.len()
    );
    assert!(
        lost_or_doubled.is_empty(),
        "{run:?}: rows (id, acknowledged, unknown, counter) outside [acknowledged, \
         acknowledged + unknown]: {lost_or_doubled:?}"
    );
    assert!(
        slowest <= 2_000,
        "{run:?}: a reset took {slowest} ms to serve the next call (goal ≤ 2 s): {recoveries:?}"
    );
}

macro_rules! resets {
    ($($test:ident: $run:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            survives_resets($run).await;
        }
    )*};
}

resets! {
    local_one_row: Run::new(LockKind::Local);
    row_several_rows: Run { rows: 4, ..Run::new(LockKind::Row) };
    pg_advisory_one_row: Run::new(LockKind::PgAdvisory);
    table_one_row: Run::new(LockKind::Table);
    redis_one_row: Run::new(LockKind::Redis);
    local_combined_one_row: Run { tasks: 8, combine: true, ..Run::new(LockKind::Local) };
    row_combined_several_rows: Run { tasks: 8, rows: 3, combine: true, ..Run::new(LockKind::Row) };
    local_optimistic_several_rows: Run { rows: 3, optimistic: true, ..Run::new(LockKind::Local) };
    local_two_flights_one_row: Run { two_flights: true, ..Run::new(LockKind::Local) };
    pg_advisory_two_flights_combined_several_rows: Run {
        tasks: 8, rows: 3, combine: true, two_flights: true, ..Run::new(LockKind::PgAdvisory)
    };
    mariadb_local_one_row: Run::mariadb(LockKind::Local);
    mariadb_local_two_flights_one_row: Run { two_flights: true, ..Run::mariadb(LockKind::Local) };
    mariadb_row_several_rows: Run { rows: 4, ..Run::mariadb(LockKind::Row) };
    mariadb_table_one_row: Run::mariadb(LockKind::Table);
    mariadb_mysql_named_one_row: Run::mariadb(LockKind::MySqlNamed);
    mariadb_local_combined_one_row: Run { tasks: 8, combine: true, ..Run::mariadb(LockKind::Local) };
    mariadb_local_optimistic_several_rows:
        Run { rows: 3, optimistic: true, ..Run::mariadb(LockKind::Local) };
}
