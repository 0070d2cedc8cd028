//! The comparison runner: every comparison measures both sides in the same run, interleaved
//! (alternating batches), and prints the ratio of their medians.
//!
//! `cargo bench --bench scenarios` — SQLite in memory; with `DATABASE_URL_POSTGRES`,
//! `DATABASE_URL_MYSQL` and `REDIS_URL` set (and `--features postgres,mysql,redis`) also every
//! backend on those servers. `FRESHLOCK_BENCH_QUICK=1` shortens every run (for CI smoke runs).

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::{
        Arc, Mutex,
        atomic::{AtomicIsize, Ordering},
    },
    time::{Duration, Instant},
};

use async_trait::async_trait;
use entity::node;
use freshlock::lock::backend::{LeaseLock, LockGuard, LockRole};
use freshlock::lock::{LocalLock, LockName};
use freshlock::{LockBackend, LockError, LockKind, LockPolicy, OnLockFailure, Session};
use sea_orm::{ConnectionTrait, DatabaseConnection, EntityTrait};

// ---------------------------------------------------------------- counting allocator
// The only unsafe code in the workspace (the library forbids it): a global allocator that counts
// live bytes, to measure what a cached entity costs.

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

// ---------------------------------------------------------------- helpers

mod common;
#[path = "../tests/common/delay.rs"]
mod delay;

use common::{database, four_statements, hand_written, increment};
use workload::{drupal, percentile_ms};

fn quick() -> bool {
    std::env::var_os("FRESHLOCK_BENCH_QUICK").is_some()
}

fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

/// Runs `a` and `b` in alternating batches; returns median µs per op of each.
async fn interleaved<A, B, FA, FB>(rounds: usize, batch: usize, mut a: A, mut b: B) -> (f64, f64)
where
    A: FnMut() -> FA,
    B: FnMut() -> FB,
    FA: Future<Output = ()>,
    FB: Future<Output = ()>,
{
    let (mut sa, mut sb) = (Vec::new(), Vec::new());
    for _ in 0..batch {
        a().await;
        b().await;
    }
    for _ in 0..rounds {
        let started = Instant::now();
        for _ in 0..batch {
            a().await;
        }
        sa.push(started.elapsed().as_secs_f64() * 1e6 / batch as f64);
        let started = Instant::now();
        for _ in 0..batch {
            b().await;
        }
        sb.push(started.elapsed().as_secs_f64() * 1e6 / batch as f64);
    }
    (median(&mut sa), median(&mut sb))
}

fn row(name: &str, ours: f64, theirs: f64, goal: &str) {
    println!(
        "| {name} | {ours:.2} µs | {theirs:.2} µs | {:.2}× | {goal} |",
        ours / theirs
    );
}

fn session(db: &DatabaseConnection, lock: Arc<dyn LockBackend>) -> Session {
    Session::builder(db.clone())
        .lock(lock)
        .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
        .build()
        .expect("session")
}

// ---------------------------------------------------------------- 1. cached load

async fn cached_load() {
    let db = database("sqlite::memory:", 10, 1).await;
    let session = Session::new(db.clone());
    let nodes = session.repository::<node::Entity>();
    nodes.load(1).await.expect("load");
    let (rounds, batch) = if quick() { (5, 200) } else { (30, 2000) };
    let (ours, theirs) = interleaved(
        rounds,
        batch,
        || async {
            std::hint::black_box(nodes.load(1).await.expect("hit"));
        },
        || async {
            std::hint::black_box(node::Entity::find_by_id(1).one(&db).await.expect("find"));
        },
    )
    .await;
    println!(
        "| `load` hit vs `find_by_id` (SQLite memory) | {ours:.3} µs | {theirs:.2} µs | {:.0}× faster | ≥ 50× faster |",
        theirs / ours
    );
}

// ---------------------------------------------------------------- 2. locked_update vs hand-written

async fn single_task(label: &str, url: &str, kinds: &[LockKind], redis: Option<&str>) {
    let db = database(url, 2, 4).await;
    let (rounds, batch) = if quick() { (3, 20) } else { (15, 100) };
    for &kind in kinds {
        if kind == LockKind::Redis && redis.is_none() {
            continue;
        }
        let lock: Arc<dyn LockBackend> = if kind == LockKind::Local {
            Arc::new(LocalLock::new())
        } else {
            kind.connect(&db, url, redis).await.expect("backend")
        };
        let session = session(&db, lock);
        let (ours, theirs) = interleaved(
            rounds,
            batch,
            || increment(&session, 1),
            || hand_written(&db, 2),
        )
        .await;
        let goal = match (label, kind) {
            ("SQLite", LockKind::Local) => "≤ 1.2×",
            ("PostgreSQL", _) => "best backend ≤ 1.3×",
            _ => "",
        };
        row(
            &format!("`locked_update` ({kind}) vs hand-written txn ({label})"),
            ours,
            theirs,
            goal,
        );
    }
    // The one-statement optimistic write (issue 14's lever 2): the row is cached and current,
    // so each call is one guarded UPDATE … RETURNING.
    let optimistic = Session::builder(db.clone())
        .lock(Arc::new(LocalLock::new()))
        .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
        .version_column::<node::Entity>(node::Column::Changed)
        .optimistic_first(true)
        .build()
        .expect("session");
    let (ours, theirs) = interleaved(
        rounds,
        batch,
        || increment(&optimistic, 1),
        || hand_written(&db, 2),
    )
    .await;
    row(
        &format!("`locked_update` optimistic-first (local) vs hand-written txn ({label})"),
        ours,
        theirs,
        "",
    );
}

// ---------------------------------------------------------------- 3. hot key, 4. spread

/// Records when each lease was granted and released, for handoff latency.
#[derive(Debug)]
struct Timed {
    inner: Arc<dyn LockBackend>,
    events: Arc<Mutex<Vec<(Instant, Instant)>>>,
}

impl LockBackend for Timed {
    fn queue(&self) -> Option<&dyn LockBackend> {
        self.inner.queue()
    }

    fn kind(&self) -> freshlock::LockKind {
        self.inner.kind()
    }

    fn role(&self) -> LockRole<'_> {
        match self.inner.role() {
            // Nothing to time: the lock lives in the transaction.
            LockRole::Transaction(lock) => LockRole::Transaction(lock),
            LockRole::Lease(_) => LockRole::Lease(self),
        }
    }
}

#[async_trait]
impl LeaseLock for Timed {
    async fn acquire(
        &self,
        name: &LockName,
        wait: Duration,
        ttl: Duration,
    ) -> Result<Option<Box<dyn LockGuard>>, LockError> {
        let guard = self.inner.acquire(name, wait, ttl).await?;
        Ok(guard.map(|inner| {
            Box::new(TimedGuard {
                inner: Some(inner),
                granted: Instant::now(),
                events: Arc::clone(&self.events),
            }) as Box<dyn LockGuard>
        }))
    }
}

#[derive(Debug)]
struct TimedGuard {
    inner: Option<Box<dyn LockGuard>>,
    granted: Instant,
    events: Arc<Mutex<Vec<(Instant, Instant)>>>,
}

#[async_trait]
impl LockGuard for TimedGuard {
    // Its own fencing, not the inner guard's: only `verify` is passed on, so the lease is never
    // freed by the write's commit (`verify_and_release_in` keeps its default) and every release
    // goes through `release` below.
    fn fencing(&self) -> Option<&dyn freshlock::lock::backend::Fencing> {
        Some(self)
    }

    async fn release(mut self: Box<Self>) -> Result<(), LockError> {
        let released = Instant::now();
        let result = match self.inner.take() {
            Some(inner) => inner.release().await,
            None => Ok(()),
        };
        if let Ok(mut events) = self.events.lock() {
            events.push((self.granted, released));
        }
        result
    }
}

#[async_trait]
impl freshlock::lock::backend::Fencing for TimedGuard {
    fn fence(&self) -> u64 {
        let inner = self.inner.as_ref().and_then(|g| g.fencing());
        inner.map_or(0, |f| f.fence())
    }

    async fn verify(&self, txn: &sea_orm::DatabaseTransaction) -> Result<bool, LockError> {
        match self.inner.as_ref() {
            Some(inner) => inner.verify(txn).await,
            None => Ok(false),
        }
    }
}

/// Updates per second of `tasks` tasks, each running `op` `per_task` times on row
/// `task % rows + 1`.
async fn throughput_of<F, Fut>(tasks: usize, rows: usize, per_task: usize, op: F) -> f64
where
    F: Fn(i32) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let op = op.clone();
            tokio::spawn(async move {
                for _ in 0..per_task {
                    op((t % rows) as i32 + 1).await;
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.expect("task");
    }
    (tasks * per_task) as f64 / started.elapsed().as_secs_f64()
}

async fn throughput(session: &Session, tasks: usize, rows: usize, per_task: usize) -> f64 {
    let session = session.clone();
    throughput_of(tasks, rows, per_task, move |id| {
        let session = session.clone();
        async move { increment(&session, id).await }
    })
    .await
}

/// The database's own floor: the hand-written transaction (no freshlock), same task counts.
async fn hand_written_throughput(
    db: &DatabaseConnection,
    tasks: usize,
    rows: usize,
    per_task: usize,
) -> f64 {
    let db = db.clone();
    throughput_of(tasks, rows, per_task, move |id| {
        let db = db.clone();
        async move { hand_written(&db, id).await }
    })
    .await
}

async fn contention(label: &str, url: &str, kinds: &[LockKind], redis: Option<&str>) {
    let db = database(url, 16, 20).await;
    let (total, rounds): (usize, usize) = if quick() { (64, 1) } else { (320, 7) };
    let mut samples = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..rounds {
        for (i, tasks) in [1, 4, 16].into_iter().enumerate() {
            samples[i].push(hand_written_throughput(&db, tasks, 1, total / tasks).await);
        }
        samples[3].push(hand_written_throughput(&db, 16, 16, total / 16).await);
    }
    let floor: Vec<f64> = samples.iter_mut().map(|s| median(s)).collect();
    println!(
        "| {label} | hand-written txn (no freshlock) | {:.0} | {:.0} | {:.0} | {:.2}× | | {:.0} ({:.2}×) |",
        floor[0],
        floor[1],
        floor[2],
        floor[2] / floor[0],
        floor[3],
        floor[3] / floor[0],
    );
    for &kind in kinds {
        if kind == LockKind::Redis && redis.is_none() {
            continue;
        }
        let inner: Arc<dyn LockBackend> = if kind == LockKind::Local {
            Arc::new(LocalLock::new())
        } else {
            kind.connect(&db, url, redis).await.expect("backend")
        };
        let events = Arc::new(Mutex::new(Vec::new()));
        let timed = Arc::new(Timed {
            inner,
            events: Arc::clone(&events),
        });
        let session = session(&db, timed);
        // 1, 4 and 16 tasks measured in turn, `rounds` times, and the median of each kept: the
        // three are compared under the same drift of the machine and the server (a single run
        // per cell varied by ±25 % here, mostly with the servers' commit flushes).
        let mut samples = [Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..rounds {
            for (i, tasks) in [1, 4, 16].into_iter().enumerate() {
                samples[i].push(throughput(&session, tasks, 1, total / tasks).await);
            }
        }
        let results: Vec<f64> = samples.iter_mut().map(|s| median(s)).collect();
        // Handoff: from one holder's release to the next holder's grant, under 16 tasks.
        events.lock().map(|mut e| e.clear()).ok();
        throughput(&session, 16, 1, total / 16).await;
        let mut spans = events.lock().map(|e| e.clone()).unwrap_or_default();
        spans.sort_by_key(|(granted, _)| *granted);
        let mut handoffs: Vec<Duration> = spans
            .windows(2)
            .filter_map(|w| w[1].0.checked_duration_since(w[0].1))
            .collect();
        let handoff = if handoffs.is_empty() {
            "n/a (ends with the transaction)".to_owned()
        } else {
            format!(
                "{:.3} / {:.3} ms",
                percentile_ms(&mut handoffs, 50),
                percentile_ms(&mut handoffs, 99)
            )
        };
        let mut spreads = Vec::new();
        for _ in 0..rounds.div_ceil(2) {
            spreads.push(throughput(&session, 16, 16, total / 16).await);
        }
        let spread = median(&mut spreads);
        println!(
            "| {label} | {kind} | {:.0} | {:.0} | {:.0} | {:.2}× | {handoff} | {spread:.0} ({:.2}×) |",
            results[0],
            results[1],
            results[2],
            results[2] / results[0],
            spread / results[0],
        );
    }
}

// ---------------------------------------------------------------- 5. the seed's workload

/// The seed's shape ([`workload::drupal`]): a job queue of `tasks` jobs, `per_node` consecutive
/// jobs for each node (one field writer each, fields in turn), pulled by `workers` queue workers
/// (each with its own session); each job loads its node, does `work` of heavy work and writes
/// its own field by `strategy`. Returns the wall time and how many fields were left without
/// their writer's value.
async fn seed_workload(
    strategy: drupal::Strategy,
    tasks: usize,
    per_node: usize,
    workers: usize,
    work: Duration,
) -> (Duration, usize) {
    let nodes = tasks.div_ceil(per_node) as i32; // 2,000 tasks: 500 nodes × 4, or 125 × 16
    let db = database("sqlite::memory:", nodes, 1).await;
    let lock = LocalLock::new();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let session = Session::builder(db.clone())
                .lock(Arc::new(lock.clone()))
                .build()
                .expect("session");
            let (lock, next) = (lock.clone(), Arc::clone(&next));
            tokio::spawn(async move {
                loop {
                    let job = next.fetch_add(1, Ordering::Relaxed);
                    if job >= tasks {
                        break;
                    }
                    let id = (job / per_node) as i32 + 1;
                    let field = drupal::Field::ALL[job % 4];
                    drupal::job(strategy, &session, &lock, id, field, work)
                        .await
                        .expect("job");
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.expect("worker");
    }
    let elapsed = started.elapsed();
    // With one writer per field (per_node = 4) exactly the lost writes; with more writers per
    // field a lower bound (a stale save may also bring back the same value).
    let lost = drupal::lost_fields(&db).await.expect("rows");
    (elapsed, lost)
}

// ---------------------------------------------------------------- 6. memory

async fn memory() {
    let n = if quick() { 10_000 } else { 100_000 };
    let db = database("sqlite::memory:", n, 1).await;
    let session = Session::new(db.clone());
    let nodes = session.repository::<node::Entity>();
    let models = node::Entity::find().all(&db).await.expect("rows");
    let model_bytes: usize = models
        .iter()
        .map(|m| std::mem::size_of::<node::Model>() + m.title.capacity())
        .sum();
    drop(models);
    let before = LIVE.load(Ordering::SeqCst);
    nodes.load_many(1..=n).await.expect("load");
    let after = LIVE.load(Ordering::SeqCst);
    let total = (after - before) as f64;
    let per_entry = total / n as f64;
    let model = model_bytes as f64 / n as f64;
    println!(
        "| memory, {n} cached rows | {per_entry:.0} B per entry | model {model:.0} B | overhead {:.0} B | ≤ 128 B |",
        per_entry - model
    );
    let bounded = Session::builder(db.clone())
        .cache_capacity(10_000)
        .build()
        .expect("session");
    bounded
        .repository::<node::Entity>()
        .load_many(1..=n)
        .await
        .expect("load");
    println!(
        "| bounded map (cap 10,000) after {n} loads | {} entries | | | stays at cap |",
        bounded.cache_stats().len
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // FRESHLOCK_BENCH_ONLY=seed|single|contention|hot|floor runs only that part (seed: the
    // seed's workload; single: sections 1, 2 and 6; contention: hot key and spread; hot: commit
    // combining, section 8; floor: section 7, pgbench's four-statement transaction next to
    // `locked_update`, PostgreSQL only; pooler: section 9, the same through PgBouncer;
    // evidence: what the commit marker costs; fsyncs, committed: MariaDB's flushes and
    // statements per write, a pool at READ COMMITTED — these three asked for by name only).
    let only = std::env::var("FRESHLOCK_BENCH_ONLY").ok();
    let wants = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let postgres = std::env::var("DATABASE_URL_POSTGRES")
        .ok()
        .filter(|_| cfg!(feature = "postgres"));
    let mysql = std::env::var("DATABASE_URL_MYSQL")
        .ok()
        .filter(|_| cfg!(feature = "mysql"));
    let redis = std::env::var("REDIS_URL")
        .ok()
        .filter(|_| cfg!(feature = "redis"));

    if wants("single") {
        comparisons(postgres.as_deref(), mysql.as_deref(), redis.as_deref()).await;
    }
    if wants("contention") {
        contentions(postgres.as_deref(), mysql.as_deref(), redis.as_deref()).await;
    }
    if wants("seed") {
        seed_table().await;
    }
    if wants("hot") {
        hot_keys(postgres.as_deref(), mysql.as_deref()).await;
    }
    #[cfg(feature = "postgres")]
    if wants("pooler") {
        let pooler = std::env::var("DATABASE_URL_POSTGRES_POOLER").ok();
        match (postgres.as_deref(), pooler.as_deref()) {
            (Some(direct), Some(pooler)) => pooler_floor(direct, pooler, redis.as_deref()).await,
            _ => println!(
                "\n(PgBouncer: skipped: needs DATABASE_URL_POSTGRES and \
                 DATABASE_URL_POSTGRES_POOLER, see .ci/pgbouncer)"
            ),
        }
    }
    // Not part of a full run: asked for by name only (issue 24's figure).
    #[cfg(feature = "postgres")]
    if only.as_deref() == Some("evidence") {
        match postgres.as_deref() {
            Some(url) => evidence_cost(url).await,
            None => println!("\n(evidence: skipped: needs DATABASE_URL_POSTGRES)"),
        }
        return;
    }
    // Not part of a full run either (issue 26): log flushes and statements per write on MariaDB
    // and PostgreSQL (fsyncs), what `mysql_read_committed` saves (committed).
    #[cfg(feature = "postgres")]
    if only.as_deref() == Some("fsyncs")
        && let Some(url) = postgres.as_deref()
    {
        postgres_fsyncs(url).await;
    }
    #[cfg(feature = "mysql")]
    if let Some(part @ ("fsyncs" | "committed")) = only.as_deref() {
        match mysql.as_deref() {
            Some(url) if part == "fsyncs" => mariadb_fsyncs(url).await,
            Some(url) => read_committed_pool(url).await,
            None => println!("\n({part}: skipped: needs DATABASE_URL_MYSQL)"),
        }
        return;
    }
    if wants("floor") {
        match postgres.as_deref() {
            Some(url) => match link_delays() {
                None => pgbench_floor(url, redis.as_deref()).await,
                // The same floor through a link with latency, pgbench and every row alike.
                Some(delays) => {
                    for one_way in delays {
                        let proxy = delay::DelayProxy::start(delay::target(url), one_way)
                            .expect("the delay proxy");
                        println!(
                            "\n### Through a link of {} µs each way (`FRESHLOCK_BENCH_DELAY_US`)",
                            one_way.as_micros()
                        );
                        pgbench_floor(&proxy.url(url), redis.as_deref()).await;
                    }
                }
            },
            None => println!(
                "\n(pgbench floor: skipped: DATABASE_URL_POSTGRES is not set, or the bench was \
                 built without the postgres feature)"
            ),
        }
        #[cfg(feature = "mysql")]
        if let Some(url) = mysql.as_deref() {
            match link_delays() {
                None => mariadb_floor(url, redis.as_deref()).await,
                Some(delays) => {
                    for one_way in delays {
                        let proxy = delay::DelayProxy::start(delay::target(url), one_way)
                            .expect("the delay proxy");
                        println!(
                            "\n### MariaDB through a link of {} µs each way",
                            one_way.as_micros()
                        );
                        mariadb_floor(&proxy.url(url), redis.as_deref()).await;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------- 7. the pgbench floor

/// `FRESHLOCK_BENCH_DELAY_US=0,1000`: run the floor through a delay proxy (`tests/common/delay.rs`)
/// adding each of these one-way delays in turn, pgbench included; unset, straight to the server.
/// (Redis, for the `redis` row, is reached directly.)
fn link_delays() -> Option<Vec<Duration>> {
    let list = std::env::var("FRESHLOCK_BENCH_DELAY_US").ok()?;
    let delays = list
        .split(',')
        .filter_map(|us| us.trim().parse::<u64>().ok())
        .map(Duration::from_micros)
        .collect::<Vec<_>>();
    (!delays.is_empty()).then_some(delays)
}

/// The four statements of the floor, as pgbench runs them (`-M prepared`, one client or 16).
const FLOOR_SCRIPT: &str = "\\set id 2\n\
BEGIN;\n\
SELECT * FROM node WHERE id = :id FOR UPDATE;\n\
UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = :id;\n\
COMMIT;\n";

/// Transactions per second of pgbench running [`FLOOR_SCRIPT`] against `url` with `clients`
/// clients for `seconds`; `None` when pgbench is missing or fails.
async fn pgbench(url: &str, clients: u32, seconds: u32) -> Option<f64> {
    pgbench_in("prepared", url, clients, seconds).await
}

/// The floor's four statements as two messages of pgbench (`-M prepared`), each a pipeline
/// (`\startpipeline` … `\endpipeline`: the extended protocol's statements sent together, one
/// `Sync`): `BEGIN` + the locking read, then the UPDATE + `COMMIT`.
const PIPELINED_SCRIPT: &str = "\\set id 2\n\
\\startpipeline\n\
BEGIN;\n\
SELECT * FROM node WHERE id = :id FOR UPDATE;\n\
\\endpipeline\n\
\\startpipeline\n\
UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = :id RETURNING *;\n\
COMMIT;\n\
\\endpipeline\n";

/// The same two messages as simple-protocol multi-statement queries (`-M simple`; `\;` joins
/// statements into one query), values inline.
const MULTI_STATEMENT_SCRIPT: &str = "BEGIN \\; SELECT * FROM node WHERE id = 2 FOR UPDATE;\n\
UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = 2 RETURNING * \\; COMMIT;\n";

/// The one-statement floor of `optimistic_first` (issue 26's goal: ≥ 0.9× of it): one
/// `UPDATE … RETURNING` by key in autocommit, the statement a cached row's optimistic write
/// sends (which also checks and bumps its version column).
const ONE_STATEMENT_SCRIPT: &str = "\\set id 2\n\
UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = :id RETURNING *;\n";

/// [`pgbench`] with protocol `mode` (`prepared`, `extended`, `simple`).
async fn pgbench_in(mode: &str, url: &str, clients: u32, seconds: u32) -> Option<f64> {
    pgbench_script(FLOOR_SCRIPT, mode, url, clients, seconds).await
}

/// pgbench running `script` with protocol `mode` against `url`: transactions per second.
async fn pgbench_script(
    script: &str,
    mode: &str,
    url: &str,
    clients: u32,
    seconds: u32,
) -> Option<f64> {
    let mode = mode.to_owned();
    let name = format!(
        "freshlock_floor_{}_{mode}_{}.sql",
        std::process::id(),
        script.len()
    );
    let path = std::env::temp_dir().join(name);
    std::fs::write(&path, script).ok()?;
    let url = url.to_owned();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new("pgbench")
            .args(["-n", "-M", &mode, "-c", &clients.to_string()])
            .args([
                "-j",
                &clients.min(2).to_string(),
                "-T",
                &seconds.to_string(),
                "-f",
            ])
            .arg(&path)
            .arg(&url)
            .output()
    })
    .await
    .ok()?
    .ok()?;
    if !output.status.success() {
        println!(
            "(pgbench failed: {})",
            String::from_utf8_lossy(&output.stderr).trim()
        );
        return None;
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("tps = "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|tps| tps.parse().ok())
}

/// Updates per second of `tasks` tasks running `op` on row `id` for `seconds`.
async fn rate<F, Fut>(tasks: usize, seconds: f64, op: F) -> f64
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut done = 0_u64;
                while Instant::now() < deadline {
                    op().await;
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0;
    for handle in handles {
        total += handle.await.expect("task");
    }
    total as f64 / started.elapsed().as_secs_f64()
}

/// What the floor table measures, besides pgbench.
#[derive(Clone, Copy)]
enum Floored {
    /// `locked_update` with this backend, 1 task.
    Backend(LockKind),
    /// `locked_update` (local) without commit markers.
    Unmarked,
    /// `locked_update` (local) in two flights (`SessionBuilder::two_flights`, PostgreSQL).
    TwoFlights,
    /// The four statements by hand in sea-orm.
    ByHand,
    /// `locked_update` optimistic-first (local).
    Optimistic,
    /// The guarded `save` of a cached, current row: one `UPDATE … RETURNING`.
    GuardedSave,
    /// 16 tasks on one row, commits combined (local).
    Combined16,
    /// 16 tasks on one row, a session each (`Session::new`-style, combining on): how a web
    /// application makes them.
    Combined16Sessions,
    /// The same, each write in two flights (`two_flights`, PostgreSQL).
    Combined16SessionsTwoFlights,
    /// The four statements in a minimal sqlx loop (prepared, plain `BEGIN`), PostgreSQL.
    Sqlx,
    /// The same four statements as two simple-query messages (`BEGIN; SELECT … FOR UPDATE`,
    /// then `UPDATE … RETURNING *; COMMIT`, values inline) in a minimal sqlx loop: what issue
    /// 26's two round trips can give at best on this client stack.
    SqlxTwo,
    /// Django 5.2's `select_for_update` + `save(update_fields)` (`benches/django/`), when
    /// `FRESHLOCK_BENCH_DJANGO` names a Python that has Django and psycopg; skipped otherwise.
    Django,
    /// `locked_update` (local) in the shape an application gets by default: a pool from
    /// `Database::connect(url)` with sea-orm's default options (checkout ping, statement
    /// logging, its pool size), on this bench's runtime — what `#[tokio::main]` gives (a
    /// multi-thread runtime, a worker per core).
    AsConnected,
    /// `locked_update` (local, no ping) on a current-thread runtime of its own (a pool of its
    /// own made there): no wake-up crosses threads.
    CurrentThread,
    /// `locked_update` optimistic-first (local, no ping) on a current-thread runtime.
    OptimisticCurrentThread,
}

impl Floored {
    const ALL: [Floored; 18] = [
        Floored::Sqlx,
        Floored::SqlxTwo,
        Floored::Django,
        Floored::Backend(LockKind::Local),
        Floored::TwoFlights,
        Floored::Backend(LockKind::Row),
        Floored::Backend(LockKind::PgAdvisory),
        Floored::Backend(LockKind::Table),
        Floored::Unmarked,
        Floored::ByHand,
        Floored::Optimistic,
        Floored::GuardedSave,
        Floored::Combined16,
        Floored::Combined16Sessions,
        Floored::Combined16SessionsTwoFlights,
        Floored::AsConnected,
        Floored::CurrentThread,
        Floored::OptimisticCurrentThread,
    ];

    /// Whether the row makes a pool of its own: one measure, no ping column.
    fn own_pool(self) -> bool {
        matches!(
            self,
            Self::Django | Self::AsConnected | Self::CurrentThread | Self::OptimisticCurrentThread
        )
    }

    fn label(self) -> String {
        match self {
            Self::Backend(kind) => format!("`locked_update` ({kind}), 1 task"),
            Self::Unmarked => "`locked_update` (local), commit markers off, 1 task".into(),
            Self::TwoFlights => "`locked_update` (local), two flights, 1 task".into(),
            Self::ByHand => "the four statements by hand in sea-orm, 1 task".into(),
            Self::Optimistic => "`locked_update` optimistic-first (local), 1 task".into(),
            Self::GuardedSave => "the guarded `save` of a cached row, 1 task".into(),
            Self::Combined16 => "`locked_update` (local, combined), 16 tasks on one row".into(),
            Self::Combined16Sessions => {
                "`locked_update` (local, combined), 16 tasks on one row, a session each".into()
            }
            Self::Combined16SessionsTwoFlights => {
                "the same, two flights, 16 tasks on one row, a session each".into()
            }
            Self::Sqlx => "the four statements in a minimal sqlx loop, 1 task".into(),
            Self::SqlxTwo => {
                "the four statements as two messages, minimal sqlx loop, 1 task".into()
            }
            Self::Django => {
                "Django 5.2 `select_for_update` + `save(update_fields)`, 1 process".into()
            }
            Self::AsConnected => {
                "`locked_update` (local), `Database::connect(url)` as is, 1 task".into()
            }
            Self::CurrentThread => "`locked_update` (local), current-thread runtime, 1 task".into(),
            Self::OptimisticCurrentThread => {
                "`locked_update` optimistic-first (local), current-thread runtime, 1 task".into()
            }
        }
    }

    fn goal(self) -> &'static str {
        match self {
            Self::Backend(LockKind::Table) => "≤ 1.3× local's time",
            Self::Backend(_) => "≥ 1.0×",
            Self::ByHand => "(sea-orm's own cost)",
            Self::Combined16 | Self::Combined16Sessions | Self::Combined16SessionsTwoFlights => {
                "≥ 3× pgbench, 16 clients"
            }
            Self::Sqlx => "(sqlx's own cost)",
            Self::SqlxTwo => "(two round trips, at best)",
            Self::TwoFlights => "≥ 0.9× the two messages",
            _ => "",
        }
    }

    /// Updates per second on `db` for `seconds`.
    async fn rate(self, db: &freshlock::Db, url: &str, redis: Option<&str>, seconds: f64) -> f64 {
        let plain = |lock: Arc<dyn LockBackend>| {
            Session::builder(db)
                .lock(lock)
                .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
        };
        let local = || Arc::new(LocalLock::new()) as Arc<dyn LockBackend>;
        let (session, tasks) = match self {
            #[cfg(feature = "postgres")]
            Self::Sqlx => {
                use sea_orm::sqlx;
                let pool = db.connection().get_postgres_connection_pool().clone();
                return rate(1, seconds, move || {
                    let pool = pool.clone();
                    async move {
                        let mut tx = pool.begin().await.expect("begin");
                        sqlx::query("SELECT * FROM node WHERE id = $1 FOR UPDATE")
                            .bind(1)
                            .fetch_one(&mut *tx)
                            .await
                            .expect("select");
                        sqlx::query("UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = $1")
                            .bind(1)
                            .execute(&mut *tx)
                            .await
                            .expect("update");
                        tx.commit().await.expect("commit");
                    }
                })
                .await;
            }
            #[cfg(feature = "postgres")]
            Self::SqlxTwo => {
                use sea_orm::sqlx::{self, Row};
                let pool = db.connection().get_postgres_connection_pool().clone();
                return rate(1, seconds, move || {
                    let pool = pool.clone();
                    async move {
                        let mut conn = pool.acquire().await.expect("acquire");
                        let read =
                            sqlx::raw_sql("BEGIN; SELECT * FROM node WHERE id = 1 FOR UPDATE")
                                .fetch_all(&mut *conn)
                                .await
                                .expect("begin and select");
                        assert_eq!(read.len(), 1);
                        let written = sqlx::raw_sql(
                            "UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = 1 \
                             RETURNING *; COMMIT",
                        )
                        .fetch_all(&mut *conn)
                        .await
                        .expect("update and commit");
                        assert!(written.first().is_some_and(|row| row.len() > 0));
                    }
                })
                .await;
            }
            #[cfg(not(feature = "postgres"))]
            Self::Sqlx | Self::SqlxTwo => return f64::NAN,
            Self::Django => return django(url, seconds).await,
            Self::AsConnected => {
                let pool = sea_orm::Database::connect(url).await.expect("connect");
                let session = Session::builder(&pool)
                    .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
                    .build()
                    .expect("session");
                let measured = rate(1, seconds, move || {
                    let session = session.clone();
                    async move { increment(&session, 1).await }
                })
                .await;
                pool.close().await.expect("close");
                return measured;
            }
            Self::CurrentThread | Self::OptimisticCurrentThread => {
                let (url, optimistic) = (
                    url.to_owned(),
                    matches!(self, Self::OptimisticCurrentThread),
                );
                let thread = std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("runtime");
                    runtime.block_on(async move {
                        let pool = common::connect_with(&url, 2, false).await;
                        let mut builder = Session::builder(&pool)
                            .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail));
                        if optimistic {
                            builder = builder
                                .version_column::<node::Entity>(node::Column::Changed)
                                .optimistic_first(true);
                        }
                        let session = builder.build().expect("session");
                        let measured = rate(1, seconds, move || {
                            let session = session.clone();
                            async move { increment(&session, 1).await }
                        })
                        .await;
                        pool.close().await.expect("close");
                        measured
                    })
                });
                return tokio::task::spawn_blocking(move || thread.join().expect("thread"))
                    .await
                    .expect("join");
            }
            Self::Combined16Sessions | Self::Combined16SessionsTwoFlights => {
                let db = db.clone();
                let two_flights = matches!(self, Self::Combined16SessionsTwoFlights);
                return rate(16, seconds, move || {
                    // A session per call, as a request handler makes one from the `Db` the
                    // application keeps: they meet in its rooms.
                    let session = Session::builder(&db)
                        .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
                        .combine_commits(true)
                        .two_flights(two_flights)
                        .build()
                        .expect("session");
                    async move { increment(&session, 1).await }
                })
                .await;
            }
            Self::GuardedSave => {
                let session = plain(local())
                    .version_column::<node::Entity>(node::Column::Changed)
                    .build()
                    .expect("session");
                return rate(1, seconds, move || {
                    let session = session.clone();
                    async move { save_current(&session, 1).await }
                })
                .await;
            }
            Self::ByHand => {
                let db = db.clone();
                return rate(1, seconds, move || {
                    let db = db.clone();
                    async move { four_statements(db.connection(), 1).await }
                })
                .await;
            }
            Self::Backend(LockKind::Local) => (plain(local()), 1),
            Self::Backend(kind) => (
                plain(kind.connect(db, url, redis).await.expect("backend")),
                1,
            ),
            Self::Unmarked => (plain(local()).commit_markers(false), 1),
            Self::TwoFlights => (plain(local()).two_flights(true), 1),
            Self::Optimistic => (
                plain(local())
                    .version_column::<node::Entity>(node::Column::Changed)
                    .optimistic_first(true),
                1,
            ),
            Self::Combined16 => (plain(local()).combine_commits(true), 16),
        };
        let session = session.build().expect("session");
        rate(tasks, seconds, move || {
            let session = session.clone();
            async move { increment(&session, 1).await }
        })
        .await
    }
}

/// The guarded `save` of row `id` as `session` has it cached (read once): one
/// `UPDATE … RETURNING` that finds the row as read. A row another bench row changed since is a
/// conflict, after which it is read again.
async fn save_current(session: &Session, id: i32) {
    let repository = session.repository::<node::Entity>();
    loop {
        let row = repository.load(id).await.expect("load").expect("the row");
        let mut model = sea_orm::IntoActiveModel::into_active_model((*row).clone());
        model.score = sea_orm::Set(Some(row.score.unwrap_or(0) + 1));
        match repository.save(model).await.expect("save") {
            freshlock::SaveOutcome::Updated(_) => return,
            _ => {
                repository.reset_cache([id]).expect("reset");
            }
        }
    }
}

/// Updates per second of Django's locked write (`benches/django/select_for_update.py`) on `url`
/// for `seconds`, with the Python `FRESHLOCK_BENCH_DJANGO` names; NaN without it (or when the
/// script fails, which it does when its own count does not match).
async fn django(url: &str, seconds: f64) -> f64 {
    let Some(python) = std::env::var_os("FRESHLOCK_BENCH_DJANGO") else {
        return f64::NAN;
    };
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/django/select_for_update.py"
    );
    let url = url.to_owned();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg(script)
            .args([
                "--url",
                &url,
                "--id",
                "1",
                "--seconds",
                &seconds.to_string(),
            ])
            .output()
    })
    .await
    .expect("join");
    match output {
        Ok(output) if output.status.success() => String::from_utf8_lossy(&output.stdout)
            .lines()
            .find_map(|line| line.strip_prefix("updates/s: "))
            .and_then(|rate| rate.trim().parse().ok())
            .unwrap_or(f64::NAN),
        Ok(output) => {
            println!(
                "(the Django script failed: {})",
                String::from_utf8_lossy(&output.stderr).trim()
            );
            f64::NAN
        }
        Err(e) => {
            println!("(the Django script did not start: {e})");
            f64::NAN
        }
    }
}

/// Issue 14's goals against the floor: pgbench's four-statement transaction with one client and
/// with 16 on one row, next to `locked_update` on the same table, in interleaved rounds (3, or 1
/// with `FRESHLOCK_BENCH_QUICK`), medians reported. Each of ours runs on a pool that pings a
/// connection when it hands it out (sqlx's `test_before_acquire`, on by default: one round trip
/// per transaction that pgbench does not make) and on one that does not.
async fn pgbench_floor(url: &str, redis: Option<&str>) {
    let (rounds, seconds) = if quick() { (1, 1) } else { (3, 3) };
    let db = database(url, 2, 20).await;
    let quiet = common::connect_with(url, 20, false).await;
    // pgbench alone first, for 10 s with nothing else running: the figure each round's 3 s run
    // is read against.
    let alone = pgbench(url, 1, if quick() { 1 } else { 10 }).await;
    if let Some(alone) = alone {
        println!("\npgbench alone, 1 client, 10 s: {alone:.0} tps");
    }
    let (mut floor, mut floor16) = (Vec::new(), Vec::new());
    let (mut pipelined, mut multi, mut single) = (Vec::new(), Vec::new(), Vec::new());
    let mut samples = vec![(Vec::new(), Vec::new()); Floored::ALL.len()];
    for _ in 0..rounds {
        let Some(one) = pgbench(url, 1, seconds).await else {
            println!("\n(pgbench not available: no floor)");
            return;
        };
        floor.push(one);
        floor16.push(pgbench(url, 16, seconds).await.unwrap_or(f64::NAN));
        let two = pgbench_script(PIPELINED_SCRIPT, "prepared", url, 1, seconds).await;
        pipelined.push(two.unwrap_or(f64::NAN));
        let two = pgbench_script(MULTI_STATEMENT_SCRIPT, "simple", url, 1, seconds).await;
        multi.push(two.unwrap_or(f64::NAN));
        let one = pgbench_script(ONE_STATEMENT_SCRIPT, "prepared", url, 1, seconds).await;
        single.push(one.unwrap_or(f64::NAN));
        for (what, (pinged, unpinged)) in Floored::ALL.iter().zip(samples.iter_mut()) {
            // A row with a pool of its own (Django's connection, a default pool, another
            // runtime's) is measured once: our pool's ping is nothing to it.
            if !what.own_pool() {
                pinged.push(
                    what.rate(&freshlock::Db::from(&db), url, redis, f64::from(seconds))
                        .await,
                );
            }
            unpinged.push(
                what.rate(&freshlock::Db::from(&quiet), url, redis, f64::from(seconds))
                    .await,
            );
        }
    }
    let (floor, floor16) = (median(&mut floor), median(&mut floor16));
    println!(
        "\nShapes: every row runs on this bench's runtime — tokio multi-thread, 2 workers, what \
         `#[tokio::main]` gives on this 2-core machine — unless its label says current-thread \
         (a runtime of its own on one OS thread, pool of 2, no ping). The two columns are the \
         bench's pools of 20 connections with sqlx's checkout ping (sea-orm's default) and \
         without it; `Database::connect(url)` as is: sea-orm's default options and pool, one \
         measure."
    );
    println!(
        "\n| on PostgreSQL, one row (medians of {rounds}) | updates/s (pool pings on checkout) | updates/s (no ping) | pgbench floor | ratio (no ping) | goal |"
    );
    println!("|---|---|---|---|---|---|");
    let (mut local, mut django, mut optimistic) = (f64::NAN, f64::NAN, f64::NAN);
    let (mut optimistic_current, mut saved) = (f64::NAN, f64::NAN);
    let mut rows = Vec::new();
    for (what, (pinged, unpinged)) in Floored::ALL.iter().zip(samples.iter_mut()) {
        // No ping column for a row that does not use our pool (Django).
        let pinged = (!pinged.is_empty()).then(|| median(pinged));
        let pinged_text = pinged.map_or_else(|| "—".to_owned(), |p| format!("{p:.0}"));
        let unpinged = median(unpinged);
        let base = if matches!(
            what,
            Floored::Combined16
                | Floored::Combined16Sessions
                | Floored::Combined16SessionsTwoFlights
        ) {
            floor16
        } else {
            floor
        };
        if matches!(what, Floored::Backend(LockKind::Local)) {
            local = unpinged;
        }
        if matches!(what, Floored::Django) {
            django = unpinged;
        }
        if matches!(what, Floored::Optimistic) {
            optimistic = unpinged;
        }
        if matches!(what, Floored::OptimisticCurrentThread) {
            optimistic_current = unpinged;
        }
        if matches!(what, Floored::GuardedSave) {
            saved = unpinged;
        }
        let extra = if matches!(what, Floored::Backend(LockKind::Table)) {
            format!(" ({:.2}× local's time)", local / unpinged)
        } else {
            String::new()
        };
        rows.push(serde_json::json!({
            "row": what.label(), "pinged": pinged.and_then(finite), "no_ping": finite(unpinged),
            "floor": finite(base), "ratio": finite(unpinged / base),
        }));
        println!(
            "| {} | {pinged_text} | {unpinged:.0} | {base:.0}{} | {:.2}×{extra} | {} |",
            what.label(),
            if matches!(
                what,
                Floored::Combined16
                    | Floored::Combined16Sessions
                    | Floored::Combined16SessionsTwoFlights
            ) {
                " (16 clients)"
            } else {
                ""
            },
            unpinged / base,
            what.goal()
        );
    }
    let (pipelined, multi) = (median(&mut pipelined), median(&mut multi));
    println!(
        "\npgbench, the same four statements as two messages (medians of {rounds}): pipelined \
         (extended protocol, `-M prepared`) {pipelined:.0} tps = {:.2}× the floor; multi-statement \
         simple queries (values inline) {multi:.0} tps = {:.2}×",
        pipelined / floor,
        multi / floor
    );
    let single = median(&mut single);
    write_json(serde_json::json!({
        "scenario": "floor", "database": "postgres", "rounds": rounds,
        "pgbench_alone": alone, "pgbench": finite(floor), "pgbench_16": finite(floor16),
        "pgbench_pipelined": finite(pipelined), "pgbench_one_statement": finite(single),
        "rows": rows,
    }));
    println!(
        "\npgbench, one `UPDATE … RETURNING` in autocommit (the one-statement floor, \
         medians of {rounds}): {single:.0} tps; `locked_update` optimistic-first (no ping) ÷ it: \
         {:.2}× on the multi-thread runtime, {:.2}× on a current-thread one; the guarded \
         `save` ÷ it: {:.2}× (goal ≥ 0.9×)",
        optimistic / single,
        optimistic_current / single,
        saved / single
    );
    if django.is_finite() {
        println!(
            "\n`locked_update` (local, no ping) ÷ Django 5.2's locked write: {:.2}× (goal ≥ 5×)",
            local / django
        );
    } else {
        println!(
            "\n(Django: skipped; set FRESHLOCK_BENCH_DJANGO to a Python with Django 5.2 and psycopg)"
        );
    }
}

/// A measured rate for JSON: `null` when it was not measured (NaN).
fn finite(rate: f64) -> Option<f64> {
    rate.is_finite().then_some((rate * 100.0).round() / 100.0)
}

/// Writes `report` to the file `FRESHLOCK_BENCH_JSON` names, when set (`benches/chart.py`
/// draws `BENCHMARKS.svg` from it).
fn write_json(report: serde_json::Value) {
    let Ok(path) = std::env::var("FRESHLOCK_BENCH_JSON") else {
        return;
    };
    match serde_json::to_string_pretty(&report) {
        Ok(text) => {
            if let Err(e) = std::fs::write(&path, text + "\n") {
                println!("(could not write {path}: {e})");
            }
        }
        Err(e) => println!("(could not encode the results: {e})"),
    }
}

/// What the crash-safe commit evidence costs a `locked_update` on PostgreSQL (issue 24): the
/// transaction id checked against the server incarnation (the default with
/// `freshlock_incarnation`), a marker row riding in the guarded UPDATE (a database without that
/// table: `freshlock_bench_markers` on the same server), and `commit_markers(false)` (0.1's
/// cost, no evidence); local lock, one task, pools without the checkout ping; 7 interleaved
/// rounds of 3 s (the order rotated every round), medians. `FRESHLOCK_BENCH_ONLY=evidence`
/// runs it alone.
#[cfg(feature = "postgres")]
async fn evidence_cost(url: &str) {
    let rounds = if quick() { 1 } else { 7 };
    let _ = database(url, 2, 2).await;
    let quiet = common::connect_with(url, 20, false).await;
    // The same tables in a database of their own, without `freshlock_incarnation`.
    let (server, _) = url.rsplit_once('/').expect("a database URL");
    let markers_url = format!("{server}/freshlock_bench_markers");
    let admin = common::connect_with(url, 1, false).await;
    let _ = admin
        .execute_unprepared("CREATE DATABASE freshlock_bench_markers")
        .await;
    admin.close().await.ok();
    let _ = database(&markers_url, 2, 2).await;
    common::connect_with(&markers_url, 1, false)
        .await
        .execute_unprepared("DROP TABLE IF EXISTS freshlock_incarnation")
        .await
        .expect("drop freshlock_incarnation");
    let quiet_markers = common::connect_with(&markers_url, 20, false).await;
    let (mut xid, mut marked, mut unmarked) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        for i in 0..3 {
            match (i + round) % 3 {
                0 => {
                    let what = Floored::Backend(LockKind::Local);
                    xid.push(
                        what.rate(&freshlock::Db::from(&quiet), url, None, 3.0)
                            .await,
                    );
                }
                1 => {
                    let what = Floored::Backend(LockKind::Local);
                    marked.push(
                        what.rate(
                            &freshlock::Db::from(&quiet_markers),
                            &markers_url,
                            None,
                            3.0,
                        )
                        .await,
                    );
                }
                _ => unmarked.push(
                    Floored::Unmarked
                        .rate(&freshlock::Db::from(&quiet), url, None, 3.0)
                        .await,
                ),
            }
        }
    }
    let (xid, marked, unmarked) = (median(&mut xid), median(&mut marked), median(&mut unmarked));
    println!(
        "\n| on PostgreSQL, one row, no ping (medians of {rounds} interleaved rounds of 3 s) | updates/s | cost |"
    );
    println!("|---|---|---|");
    println!(
        "| `locked_update` (local), transaction id + incarnation | {xid:.0} | {:.1} % |",
        100.0 * (1.0 - xid / unmarked)
    );
    println!(
        "| `locked_update` (local), marker in the UPDATE | {marked:.0} | {:.1} % |",
        100.0 * (1.0 - marked / unmarked)
    );
    println!("| `locked_update` (local), commit markers off | {unmarked:.0} | |");
}

/// A MySQL/MariaDB pool at READ COMMITTED (`freshlock::db::mysql_read_committed`, no `SET
/// TRANSACTION` before each `BEGIN`) against one at the server's default: `locked_update`
/// (local) and sea-orm's four statements by hand (which send no `SET TRANSACTION` on either: the
/// control), in interleaved rounds of 3 s with the order swapped each round; medians.
#[cfg(feature = "mysql")]
async fn read_committed_pool(url: &str) {
    let rounds = if quick() { 1 } else { 8 };
    let _ = database(url, 2, 2).await;
    let default = common::connect_with(url, 20, false).await;
    let committed = committed_pool(url).await;
    let pools = [&default, &committed];
    let mut samples = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    for round in 0..rounds {
        for i in 0..2 {
            let which = (i + round) % 2;
            let pool = pools[which];
            let local = Floored::Backend(LockKind::Local);
            let pool = &freshlock::Db::from(pool);
            samples[which][0].push(local.rate(pool, url, None, 3.0).await);
            samples[which][1].push(Floored::ByHand.rate(pool, url, None, 3.0).await);
        }
    }
    println!(
        "\n| on MariaDB, one row, no ping (medians of {rounds} interleaved rounds of 3 s) | server default (REPEATABLE READ) | pool at READ COMMITTED | ratio |\n|---|---|---|---|"
    );
    let [mut on_default, mut on_committed] = samples;
    for (i, what) in [
        "`locked_update` (local)",
        "the four statements by hand in sea-orm",
    ]
    .iter()
    .enumerate()
    {
        let (a, b) = (median(&mut on_default[i]), median(&mut on_committed[i]));
        println!("| {what} | {a:.0} | {b:.0} | {:.2}× |", b / a);
    }
}

/// A session on `quiet` under `kind`'s lock (failing when it cannot be had), after 20 writes
/// of row 1 (the lock's rows made, the statements prepared): for counting what the next
/// writes cost the server.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn warmed_session(quiet: &DatabaseConnection, url: &str, kind: LockKind) -> Session {
    let session = Session::builder(quiet.clone())
        .lock(kind.connect(quiet, url, None).await.expect("backend"))
        .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
        .build()
        .expect("session");
    for _ in 0..20 {
        increment(&session, 1).await;
    }
    session
}

/// What one uncontended `locked_update` costs the PostgreSQL server, per backend: log flushes
/// (`pg_stat_wal.wal_sync`, the server's: a commit that waits for its flush makes one, the WAL
/// writer's background flushes count too) and committed transactions (`xact_commit` of the
/// database, read-only ones included), over 300 writes after 20 of warm-up, on a quiet server.
/// A backend that goes idle reports its statistics within 10 s (PostgreSQL 15's idle
/// interval), so each read waits 11 s first (and counts itself). Counts, not times, as
/// [`mariadb_fsyncs`]'s.
#[cfg(feature = "postgres")]
async fn postgres_fsyncs(url: &str) {
    use sea_orm::ConnectionTrait;
    const WRITES: u32 = 300;
    let _ = database(url, 2, 2).await;
    let quiet = common::connect_with(url, 20, false).await;
    let status = common::connect_with(url, 1, false).await;
    let read = || async {
        tokio::time::sleep(Duration::from_secs(11)).await;
        let row = status
            .query_one_raw(sea_orm::Statement::from_string(
                sea_orm::DbBackend::Postgres,
                "SELECT (SELECT wal_sync FROM pg_stat_wal)::float8 AS syncs, \
                 (SELECT xact_commit FROM pg_stat_database \
                  WHERE datname = current_database())::float8 AS commits",
            ))
            .await
            .expect("statistics")
            .expect("a row");
        let value = |name: &str| row.try_get::<f64>("", name).expect("a statistic");
        (value("syncs"), value("commits"))
    };
    println!(
        "\n| on PostgreSQL, one row, 1 task, {WRITES} writes | log flushes per write | transactions per write | ms per write (one run: a time, not a count) |\n|---|---|---|---|"
    );
    for kind in [
        LockKind::Local,
        LockKind::PgAdvisory,
        LockKind::Row,
        LockKind::Table,
    ] {
        let session = warmed_session(&quiet, url, kind).await;
        let (syncs, commits) = read().await;
        let started = Instant::now();
        for _ in 0..WRITES {
            increment(&session, 1).await;
        }
        let took = started.elapsed();
        let (syncs_after, commits_after) = read().await;
        let writes = f64::from(WRITES);
        // The first read's own transaction is counted by the second.
        println!(
            "| `locked_update` ({kind}) | {:.2} | {:.2} | {:.2} |",
            (syncs_after - syncs) / writes,
            (commits_after - commits - 1.0) / writes,
            took.as_secs_f64() * 1000.0 / writes
        );
    }
}

/// What one uncontended `locked_update` costs the MariaDB server, per backend: log flushes
/// (`Innodb_data_fsyncs`: one per committed write transaction, none for reads, `GET_LOCK` or a
/// locking read in autocommit) and statements (`Questions`, every connection's: the lock pool's
/// too), over 300 writes after 20 of warm-up, on a quiet server. Counts, not times: they tell
/// what a backend sends and commits, whatever this machine's fsync costs.
#[cfg(feature = "mysql")]
async fn mariadb_fsyncs(url: &str) {
    use sea_orm::ConnectionTrait;
    const WRITES: u32 = 300;
    let _ = database(url, 2, 2).await;
    let quiet = common::connect_with(url, 20, false).await;
    let status = common::connect_with(url, 1, false).await;
    let read = || async {
        let rows = status
            .query_all_raw(sea_orm::Statement::from_string(
                sea_orm::DbBackend::MySql,
                "SHOW GLOBAL STATUS WHERE Variable_name IN ('Innodb_data_fsyncs', 'Questions')",
            ))
            .await
            .expect("status");
        let value = |name: &str| {
            rows.iter()
                .find(|row| row.try_get_by_index::<String>(0).ok().as_deref() == Some(name))
                .and_then(|row| row.try_get_by_index::<String>(1).ok())
                .and_then(|value| value.parse::<f64>().ok())
                .expect("a status value")
        };
        (value("Innodb_data_fsyncs"), value("Questions"))
    };
    println!(
        "\n| on MariaDB, one row, 1 task, {WRITES} writes | log flushes per write | statements per write |\n|---|---|---|"
    );
    for kind in [
        LockKind::Local,
        LockKind::Row,
        LockKind::MySqlNamed,
        LockKind::Table,
    ] {
        let session = warmed_session(&quiet, url, kind).await;
        let (fsyncs, questions) = read().await;
        for _ in 0..WRITES {
            increment(&session, 1).await;
        }
        let (fsyncs_after, questions_after) = read().await;
        let writes = f64::from(WRITES);
        // The second status read is one statement of its own.
        println!(
            "| `locked_update` ({kind}) | {:.2} | {:.2} |",
            (fsyncs_after - fsyncs) / writes,
            (questions_after - questions - 1.0) / writes
        );
    }
}

/// A pool of 20 connections, no ping on checkout, each connection at READ COMMITTED.
#[cfg(feature = "mysql")]
async fn committed_pool(url: &str) -> DatabaseConnection {
    let mut options = sea_orm::ConnectOptions::new(url);
    options
        .test_before_acquire(false)
        .max_connections(20)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .sqlx_logging(false);
    freshlock::db::mysql_read_committed(&mut options);
    sea_orm::Database::connect(options).await.expect("connect")
}

/// The MariaDB floor: the same four statements in a minimal sqlx loop (prepared statements,
/// plain `BEGIN`, no ping on checkout), next to `locked_update` on the same table.
#[cfg(feature = "mysql")]
async fn mariadb_floor(url: &str, redis: Option<&str>) {
    use sea_orm::sqlx;
    let (rounds, seconds) = if quick() { (1, 1.0) } else { (3, 3.0) };
    let _ = database(url, 2, 2).await;
    let quiet = common::connect_with(url, 20, false).await;
    let pool = quiet.get_mysql_connection_pool().clone();
    let floor_rate = || {
        let pool = pool.clone();
        rate(1, seconds, move || {
            let pool = pool.clone();
            async move {
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query("SELECT * FROM node WHERE id = ? FOR UPDATE")
                    .bind(1)
                    .fetch_one(&mut *tx)
                    .await
                    .expect("select");
                sqlx::query("UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = ?")
                    .bind(1)
                    .execute(&mut *tx)
                    .await
                    .expect("update");
                tx.commit().await.expect("commit");
            }
        })
    };
    // freshlock's seven statements on MariaDB (`SET TRANSACTION`, `BEGIN`, the reload, the
    // commit marker, the UPDATE, the read-back, `COMMIT`) as two multi-statement messages,
    // values inline: what issue 26's two round trips can give at best here.
    let tokens = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let two_rate = || {
        let pool = pool.clone();
        let tokens = Arc::clone(&tokens);
        rate(1, seconds, move || {
            let pool = pool.clone();
            let token = tokens.fetch_add(1, Ordering::Relaxed);
            async move {
                let mut conn = pool.acquire().await.expect("acquire");
                let read = sqlx::raw_sql(
                    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN; \
                     SELECT * FROM node WHERE id = 1 FOR UPDATE",
                )
                .fetch_all(&mut *conn)
                .await
                .expect("begin and select");
                assert_eq!(read.len(), 1);
                let write = format!(
                    "INSERT INTO freshlock_commit (token, created_at) VALUES ('bench-two-{token}', 0); \
                     UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = 1; \
                     SELECT * FROM node WHERE id = 1; COMMIT"
                );
                let written = sqlx::raw_sql(sqlx::AssertSqlSafe(write))
                    .fetch_all(&mut *conn)
                    .await
                    .expect("write and commit");
                assert_eq!(written.len(), 1);
            }
        })
    };
    let kinds = [
        LockKind::Local,
        LockKind::Row,
        LockKind::MySqlNamed,
        LockKind::Table,
    ];
    // The same writes on a pool whose connections default to READ COMMITTED
    // (`freshlock::db::mysql_read_committed`): no `SET TRANSACTION` before each `BEGIN`.
    let committed = committed_pool(url).await;
    let committed_kinds = [LockKind::Local, LockKind::Row, LockKind::MySqlNamed];
    let mut on_committed = vec![Vec::new(); committed_kinds.len()];
    let (mut floor, mut two) = (Vec::new(), Vec::new());
    let mut ours = vec![Vec::new(); kinds.len() + 2];
    for _ in 0..rounds {
        floor.push(floor_rate().await);
        two.push(two_rate().await);
        for (kind, samples) in committed_kinds.iter().zip(on_committed.iter_mut()) {
            let floored = Floored::Backend(*kind);
            samples.push(
                floored
                    .rate(&freshlock::Db::from(&committed), url, redis, seconds)
                    .await,
            );
        }
        for (kind, samples) in kinds.iter().zip(ours.iter_mut()) {
            samples.push(
                Floored::Backend(*kind)
                    .rate(&freshlock::Db::from(&quiet), url, redis, seconds)
                    .await,
            );
        }
        ours[kinds.len()].push(
            Floored::ByHand
                .rate(&freshlock::Db::from(&quiet), url, redis, seconds)
                .await,
        );
        ours[kinds.len() + 1].push(
            Floored::TwoFlights
                .rate(&freshlock::Db::from(&quiet), url, redis, seconds)
                .await,
        );
    }
    quiet
        .execute_unprepared("DELETE FROM freshlock_commit WHERE token LIKE 'bench-two-%'")
        .await
        .expect("delete the bench's markers");
    let (floor, two) = (median(&mut floor), median(&mut two));
    println!(
        "\n| on MariaDB, one row, no ping on checkout (medians of {rounds}) | updates/s | floor: minimal sqlx loop | ratio | goal |\n|---|---|---|---|---|"
    );
    println!(
        "| freshlock's seven statements as two messages, minimal sqlx loop, 1 task | {two:.0} | {floor:.0} | {:.2}× | (two round trips, at best) |",
        two / floor
    );
    for (i, samples) in ours.iter_mut().enumerate() {
        let what = match kinds.get(i) {
            Some(kind) => Floored::Backend(*kind),
            None if i == kinds.len() => Floored::ByHand,
            None => Floored::TwoFlights,
        };
        let rate = median(samples);
        println!(
            "| {} | {rate:.0} | {floor:.0} | {:.2}× | {} |",
            what.label(),
            rate / floor,
            what.goal()
        );
    }
    for (kind, samples) in committed_kinds.iter().zip(on_committed.iter_mut()) {
        let rate = median(samples);
        println!(
            "| `locked_update` ({kind}), pool at READ COMMITTED, 1 task | {rate:.0} | {floor:.0} | {:.2}× | {} |",
            rate / floor,
            Floored::Backend(*kind).goal()
        );
    }
}

// ---------------------------------------------------------------- 9. through PgBouncer

/// What a transaction pooler costs: PgBouncer (transaction mode, `DISCARD ALL` after each
/// transaction) in front of the same server, with a pool adopted by
/// `freshlock::transaction_pooler` (no statement cache, single statements in a transaction of
/// their own). pgbench through the pooler (`-M extended`: unnamed statements, one round trip per
/// statement; `-M prepared` does not work there) is the floor; direct numbers beside it.
#[cfg(feature = "postgres")]
async fn pooler_floor(direct: &str, pooler: &str, redis: Option<&str>) {
    let seconds = if quick() { 1.0 } else { 3.0 };
    let _ = database(direct, 2, 2).await;
    let name = direct
        .rsplit('/')
        .next()
        .and_then(|n| n.split('?').next())
        .unwrap_or("test");
    let url = format!("{}/{name}", pooler.trim_end_matches('/'));
    let mut options = sea_orm::ConnectOptions::new(&url);
    options
        .test_before_acquire(false)
        .max_connections(20)
        .sqlx_logging(false);
    let pooled = freshlock::transaction_pooler::connect(options)
        .await
        .expect("adopted pool");
    let plain = common::connect_with(direct, 20, false).await;
    let Some(floor) = pgbench_in("extended", &url, 1, seconds as u32).await else {
        println!("\n(pgbench through the pooler failed: no pooler floor)");
        return;
    };
    let floor_direct = pgbench_in("extended", direct, 1, seconds as u32)
        .await
        .unwrap_or(f64::NAN);
    println!(
        "\n| one row, 1 task | through PgBouncer (updates/s) | direct (updates/s) | vs pgbench through PgBouncer ({floor:.0}/s) | vs the four statements in sea-orm through PgBouncer |\n|---|---|---|---|---|"
    );
    let by_hand = Floored::ByHand.rate(&pooled, &url, redis, seconds).await;
    let by_hand_direct = Floored::ByHand
        .rate(&freshlock::Db::from(&plain), direct, redis, seconds)
        .await;
    println!(
        "| the four statements by hand in sea-orm | {by_hand:.0} | {by_hand_direct:.0} | {:.2}× | 1.00× |",
        by_hand / floor
    );
    println!(
        "| pgbench -M extended, 1 client | {floor:.0} | {floor_direct:.0} | 1.00× | {:.2}× |",
        floor / by_hand
    );
    for kind in [
        LockKind::Local,
        LockKind::Row,
        LockKind::PgAdvisory,
        LockKind::Table,
    ] {
        let through = Floored::Backend(kind)
            .rate(&pooled, &url, redis, seconds)
            .await;
        let direct_rate = Floored::Backend(kind)
            .rate(&freshlock::Db::from(&plain), direct, redis, seconds)
            .await;
        println!(
            "| `locked_update`, {kind} | {through:.0} | {direct_rate:.0} | {:.2}× | {:.2}× |",
            through / floor,
            through / by_hand
        );
    }
    let loads = |db: freshlock::Db| {
        let session = Session::new(db);
        rate(1, seconds, move || {
            let session = session.clone();
            async move {
                session
                    .repository::<node::Entity>()
                    .load_fresh(1)
                    .await
                    .expect("load");
            }
        })
    };
    let (through, direct_rate) = (
        loads(pooled.clone()).await,
        loads(freshlock::Db::new(plain.clone())).await,
    );
    println!("| `load_fresh` (a read) | {through:.0} | {direct_rate:.0} | | |");
}

// ---------------------------------------------------------------- 8. commit combining

/// Issue 14's hot-key goals: 16 tasks of one process on one row vs 1 task, with and without
/// `combine_commits`, on a SQLite file in WAL mode, PostgreSQL and MariaDB (and, on PostgreSQL,
/// vs pgbench with 16 clients on one row). Every run checks that the row holds exactly the
/// acknowledged increments.
async fn hot_keys(postgres: Option<&str>, mysql: Option<&str>) {
    let seconds = if quick() { 1.0 } else { 5.0 };
    println!(
        "\n| database | backend | 1 task | 16 tasks | 16 tasks, combined | combined vs 1 task | mean batch | 16 sessions, combined | vs 1 task | mean batch | goal |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let file = std::env::temp_dir().join(format!("freshlock_hot_{}.db", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let sqlite = format!("sqlite://{}?mode=rwc", file.display());
    let mut targets = vec![("SQLite file, WAL", sqlite.as_str(), "≥ 2×")];
    if let Some(url) = postgres {
        targets.push(("PostgreSQL", url, "≥ 5×"));
    }
    if let Some(url) = mysql {
        targets.push(("MariaDB", url, "≥ 5×"));
    }
    for (name, url, goal) in targets {
        let db = database(url, 2, 8).await;
        if db.get_database_backend() == sea_orm::DbBackend::Sqlite {
            db.execute_unprepared("PRAGMA journal_mode=WAL")
                .await
                .expect("WAL");
        }
        let kinds: &[LockKind] = match db.get_database_backend() {
            sea_orm::DbBackend::Postgres => &[LockKind::Local, LockKind::Row, LockKind::PgAdvisory],
            sea_orm::DbBackend::MySql => &[LockKind::Local, LockKind::Row],
            _ => &[LockKind::Local],
        };
        for &kind in kinds {
            let lock: Arc<dyn LockBackend> = if kind == LockKind::Local {
                Arc::new(LocalLock::new())
            } else {
                kind.connect(&db, url, None).await.expect("backend")
            };
            let plain = session(&db, Arc::clone(&lock));
            // The handle an application makes once per pool and keeps in its state: sessions
            // made from it share their rooms (a bare connection would give each its own).
            let handle = freshlock::Db::new(db.clone());
            let combining = || {
                Session::builder(&handle)
                    .lock(Arc::clone(&lock))
                    .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
                    .combine_commits(true)
                    .build()
                    .expect("session")
            };
            let combined = combining();
            let one = counted(&db, 1, seconds, &plain).await.0;
            let sixteen = counted(&db, 16, seconds, &plain).await.0;
            let (together, batch) = counted(&db, 16, seconds, &combined).await;
            // One session per task, built the way a request handler builds one.
            let (each, each_batch) =
                counted_each(&db, seconds, (0..16).map(|_| combining()).collect()).await;
            println!(
                "| {name} | {kind} | {one:.0} | {sixteen:.0} | {together:.0} | {:.2}× | {batch:.1} | {each:.0} | {:.2}× | {each_batch:.1} | {goal} |",
                together / one,
                each / one
            );
        }
        if db.get_database_backend() == sea_orm::DbBackend::Postgres {
            let floor16 = pgbench(url, 16, seconds as u32).await.unwrap_or(f64::NAN);
            let lock: Arc<dyn LockBackend> = Arc::new(LocalLock::new());
            let combined = Session::builder(db.clone())
                .lock(lock)
                .combine_commits(true)
                .build()
                .expect("session");
            let (together, _) = counted(&db, 16, seconds, &combined).await;
            println!(
                "| PostgreSQL | local, combined vs pgbench 16 clients on one row | {floor16:.0} (pgbench) | | {together:.0} | {:.2}× | | | | | ≥ 3× |",
                together / floor16
            );
        }
    }
    let _ = std::fs::remove_file(&file);
}

/// Updates per second of `tasks` tasks incrementing node 2 through `session` for `seconds`, and
/// the mean batch their commits carried; asserts the row gained exactly the acknowledged
/// increments.
async fn counted(
    db: &DatabaseConnection,
    tasks: usize,
    seconds: f64,
    session: &Session,
) -> (f64, f64) {
    counted_each(db, seconds, vec![session.clone(); tasks]).await
}

/// [`counted`] with a session of its own per task (one task per session given), as a web
/// service builds one per request.
async fn counted_each(db: &DatabaseConnection, seconds: f64, sessions: Vec<Session>) -> (f64, f64) {
    let before = node::Entity::find_by_id(2)
        .one(db)
        .await
        .expect("read")
        .and_then(|n| n.score)
        .unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let handles: Vec<_> = sessions
        .into_iter()
        .map(|session| {
            tokio::spawn(async move {
                let (mut done, mut batches) = (0_u64, 0_u64);
                while Instant::now() < deadline {
                    batches += u64::from(common::increment_reported(&session, 2).await);
                    done += 1;
                }
                (done, batches)
            })
        })
        .collect();
    let (mut total, mut batches) = (0, 0);
    for handle in handles {
        let (done, batch) = handle.await.expect("task");
        total += done;
        batches += batch;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let after = node::Entity::find_by_id(2)
        .one(db)
        .await
        .expect("read")
        .and_then(|n| n.score)
        .unwrap_or(0);
    assert_eq!(
        i64::from(after - before),
        total as i64,
        "every acknowledged increment is in the row, once"
    );
    (total as f64 / elapsed, batches as f64 / total.max(1) as f64)
}

/// Every backend each database can use.
const SQLITE_KINDS: [LockKind; 3] = [LockKind::Local, LockKind::Table, LockKind::Row];
const PG_KINDS: [LockKind; 5] = [
    LockKind::Local,
    LockKind::Table,
    LockKind::Row,
    LockKind::PgAdvisory,
    LockKind::Redis,
];
const MY_KINDS: [LockKind; 5] = [
    LockKind::Local,
    LockKind::Table,
    LockKind::Row,
    LockKind::MySqlNamed,
    LockKind::Redis,
];

async fn comparisons(postgres: Option<&str>, mysql: Option<&str>, redis: Option<&str>) {
    println!("\n| comparison | freshlock | baseline | ratio | goal |\n|---|---|---|---|---|");
    cached_load().await;
    single_task("SQLite", "sqlite::memory:", &SQLITE_KINDS, None).await;
    if let Some(url) = postgres {
        single_task("PostgreSQL", url, &PG_KINDS, redis).await;
    }
    if let Some(url) = mysql {
        single_task("MariaDB", url, &MY_KINDS, redis).await;
    }
    memory().await;
}

async fn contentions(postgres: Option<&str>, mysql: Option<&str>, redis: Option<&str>) {
    println!(
        "\n| database | backend | 1 task (ops/s) | 4 tasks | 16 tasks | 16 vs 1 | handoff p50 / p99 | 16 tasks on 16 rows |\n|---|---|---|---|---|---|---|---|"
    );
    contention("SQLite", "sqlite::memory:", &SQLITE_KINDS, None).await;
    if let Some(url) = postgres {
        contention("PostgreSQL", url, &PG_KINDS, redis).await;
    }
    if let Some(url) = mysql {
        contention("MariaDB", url, &MY_KINDS, redis).await;
    }
}

async fn seed_table() {
    let tasks = if quick() { 160 } else { 2000 };
    let work = Duration::from_millis(if quick() { 1 } else { 5 });
    // The seed: 4 field writers per node, 4 queue workers. Then the same 2,000 tasks with 16
    // writers per node (4 rounds of the 4 fields) and 16 workers: how the lock-around-the-work
    // cost grows with the writers that share one lock.
    for (per_node, workers) in [(4, 4), (16, 16)] {
        println!(
            "\n| the seed's workload: {tasks} tasks, {per_node} writers per node, {workers} workers, {work:?} work | wall | fields left empty |\n|---|---|---|"
        );
        let mut walls = Vec::new();
        for strategy in [
            drupal::Strategy::Freshlock,
            drupal::Strategy::Naive,
            drupal::Strategy::LockAroundWork,
        ] {
            let (wall, lost) = seed_workload(strategy, tasks, per_node, workers, work).await;
            println!(
                "| {} | {:.0} ms | {lost} |",
                strategy.name(),
                wall.as_secs_f64() * 1e3
            );
            walls.push(wall.as_secs_f64());
        }
        println!(
            "\nfreshlock vs no lock: {:.2}× (goal ≤ 1.1×); lock around the work vs freshlock: {:.1}× slower (goal ≥ 10×)",
            walls[0] / walls[1],
            walls[2] / walls[0]
        );
    }
}
