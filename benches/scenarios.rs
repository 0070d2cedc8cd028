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
use freshlock::{
    LocalLock, LockBackend, LockError, LockGuard, LockKind, LockName, LockPolicy, LockScope,
    OnLockFailure, Session,
};
use migration::{Migrator, MigratorTrait};
use sea_orm::{
    ActiveModelTrait, ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend,
    EntityTrait, IntoActiveModel, IsolationLevel, QuerySelect, Set, SqliteTransactionMode,
    TransactionOptions, TransactionTrait,
};

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

fn quick() -> bool {
    std::env::var_os("FRESHLOCK_BENCH_QUICK").is_some()
}

async fn connect(url: &str, max: u32) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(max)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .sqlx_logging(false);
    Database::connect(options).await.expect("connect")
}

/// A database with `n` nodes. Server databases are emptied first.
async fn database(url: &str, n: i32, pool: u32) -> DatabaseConnection {
    let db = connect(url, pool).await;
    Migrator::up(&db, None).await.expect("migrate");
    node::Entity::delete_many().exec(&db).await.expect("empty");
    db.execute_unprepared("DELETE FROM freshlock_lock")
        .await
        .expect("empty locks");
    let rows: Vec<_> = (1..=n)
        .map(|id| node::ActiveModel {
            id: Set(id),
            title: Set(format!("node {id}")),
            ..Default::default()
        })
        .collect();
    for chunk in rows.chunks(500) {
        node::Entity::insert_many(chunk.to_vec())
            .exec(&db)
            .await
            .expect("seed");
    }
    db
}

fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

fn percentile(samples: &mut [Duration], p: usize) -> Duration {
    samples.sort();
    samples[(samples.len() * p / 100).min(samples.len() - 1)]
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

async fn increment(session: &Session, id: i32) {
    let report = session
        .repository::<node::Entity>()
        .locked_update(id, |n| {
            let score = n.score.as_ref().unwrap_or(0);
            n.score = Set(Some(score + 1));
            Ok(())
        })
        .await
        .expect("locked_update");
    assert!(report.outcome.is_updated());
}

/// The minimal hand-written transaction: BEGIN (IMMEDIATE on SQLite), SELECT (FOR UPDATE
/// elsewhere), UPDATE of the one column, COMMIT.
async fn hand_written(db: &DatabaseConnection, id: i32) {
    let options = if db.get_database_backend() == DbBackend::Sqlite {
        TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..Default::default()
        }
    } else {
        TransactionOptions {
            isolation_level: Some(IsolationLevel::ReadCommitted),
            ..Default::default()
        }
    };
    let txn = db.begin_with_options(options).await.expect("begin");
    let mut select = node::Entity::find_by_id(id);
    if db.get_database_backend() != DbBackend::Sqlite {
        select = select.lock_exclusive();
    }
    let model = select.one(&txn).await.expect("select").expect("row");
    let score = model.score.unwrap_or(0);
    let mut am = model.into_active_model();
    am.score = Set(Some(score + 1));
    node::Entity::update(am)
        .exec_without_returning(&txn)
        .await
        .expect("update");
    txn.commit().await.expect("commit");
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
}

// ---------------------------------------------------------------- 3. hot key, 4. spread

/// Records when each lease was granted and released, for handoff latency.
#[derive(Debug)]
struct Timed {
    inner: Arc<dyn LockBackend>,
    events: Arc<Mutex<Vec<(Instant, Instant)>>>,
}

#[async_trait]
impl LockBackend for Timed {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn scope(&self) -> LockScope {
        self.inner.scope()
    }
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
    async fn lock_in_transaction(
        &self,
        txn: &sea_orm::DatabaseTransaction,
        name: &LockName,
        wait: Duration,
    ) -> Result<bool, LockError> {
        self.inner.lock_in_transaction(txn, name, wait).await
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
    fn fence(&self) -> Option<u64> {
        self.inner.as_ref().and_then(|g| g.fence())
    }
    async fn verify(&self, txn: &sea_orm::DatabaseTransaction) -> Result<bool, LockError> {
        match &self.inner {
            Some(inner) => inner.verify(txn).await,
            None => Ok(false),
        }
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

async fn throughput(session: &Session, tasks: usize, rows: usize, per_task: usize) -> f64 {
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let session = session.clone();
            tokio::spawn(async move {
                for _ in 0..per_task {
                    increment(&session, (t % rows) as i32 + 1).await;
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.expect("task");
    }
    (tasks * per_task) as f64 / started.elapsed().as_secs_f64()
}

async fn contention(label: &str, url: &str, kinds: &[LockKind], redis: Option<&str>) {
    let db = database(url, 16, 20).await;
    let total = if quick() { 64 } else { 800 };
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
        let mut results = Vec::new();
        for tasks in [1, 4, 16] {
            results.push(throughput(&session, tasks, 1, total / tasks).await);
        }
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
                percentile(&mut handoffs, 50).as_secs_f64() * 1e3,
                percentile(&mut handoffs, 99).as_secs_f64() * 1e3
            )
        };
        let spread = throughput(&session, 16, 16, total / 16).await;
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

#[derive(Copy, Clone, Debug)]
enum Mode {
    Freshlock,
    NoLock,
    LockAroundWork,
}

async fn seed_workload(mode: Mode, nodes: i32, work: Duration) -> (Duration, usize) {
    let db = database("sqlite::memory:", nodes, 1).await;
    let lock = LocalLock::new();
    let session = Session::builder(db.clone())
        .lock(Arc::new(lock.clone()))
        .build()
        .expect("session");
    let started = Instant::now();
    let fields = ["thumbnail", "summary", "score", "analysis"];
    // The seed's shape: one worker per field kind, each a queue over all the nodes in the same
    // order, so the four writers of a node reach it at about the same time.
    let handles: Vec<_> = (0..4)
        .map(|w| {
            let (session, lock, db) = (session.clone(), lock.clone(), db.clone());
            let field = fields[w];
            tokio::spawn(async move {
                let repo = session.repository::<node::Entity>();
                for id in 1..=nodes {
                    let set = |n: &mut node::ActiveModel| match field {
                        "thumbnail" => n.thumbnail = Set(Some("t".into())),
                        "summary" => n.summary = Set(Some("s".into())),
                        "score" => n.score = Set(Some(1)),
                        _ => n.analysis = Set(Some("a".into())),
                    };
                    match mode {
                        Mode::Freshlock => {
                            repo.load(id).await.expect("load");
                            tokio::time::sleep(work).await;
                            repo.locked_update(id, |n| {
                                set(n);
                                Ok(())
                            })
                            .await
                            .expect("update");
                        }
                        Mode::NoLock => {
                            let model = node::Entity::find_by_id(id)
                                .one(&db)
                                .await
                                .expect("load")
                                .expect("row");
                            tokio::time::sleep(work).await;
                            let mut whole = model.into_active_model().reset_all();
                            set(&mut whole);
                            whole.update(&db).await.expect("save");
                        }
                        Mode::LockAroundWork => {
                            let name = LockName::new(format!("node:{id}")).expect("name");
                            let guard = lock
                                .acquire(&name, Duration::from_secs(600), Duration::from_secs(60))
                                .await
                                .expect("lock")
                                .expect("held");
                            let model = node::Entity::find_by_id(id)
                                .one(&db)
                                .await
                                .expect("load")
                                .expect("row");
                            tokio::time::sleep(work).await;
                            let mut whole = model.into_active_model().reset_all();
                            set(&mut whole);
                            whole.update(&db).await.expect("save");
                            guard.release().await.expect("release");
                        }
                    }
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.expect("worker");
    }
    let elapsed = started.elapsed();
    let lost = node::Entity::find()
        .all(&db)
        .await
        .expect("rows")
        .iter()
        .map(|r| {
            usize::from(r.thumbnail.is_none())
                + usize::from(r.summary.is_none())
                + usize::from(r.score.is_none())
                + usize::from(r.analysis.is_none())
        })
        .sum();
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
    // FRESHLOCK_BENCH_ONLY=seed runs only the seed's workload.
    let only_seed = std::env::var("FRESHLOCK_BENCH_ONLY").is_ok_and(|v| v == "seed");
    let postgres = std::env::var("DATABASE_URL_POSTGRES")
        .ok()
        .filter(|_| cfg!(feature = "postgres"));
    let mysql = std::env::var("DATABASE_URL_MYSQL")
        .ok()
        .filter(|_| cfg!(feature = "mysql"));
    let redis = std::env::var("REDIS_URL")
        .ok()
        .filter(|_| cfg!(feature = "redis"));

    if !only_seed {
        comparisons(postgres.as_deref(), mysql.as_deref(), redis.as_deref()).await;
    }
    seed_table().await;
}

async fn comparisons(postgres: Option<&str>, mysql: Option<&str>, redis: Option<&str>) {
    let pg_kinds = [
        LockKind::Local,
        LockKind::Table,
        LockKind::Row,
        LockKind::PgAdvisory,
        LockKind::Redis,
    ];
    let my_kinds = [
        LockKind::Local,
        LockKind::Table,
        LockKind::Row,
        LockKind::MySqlNamed,
        LockKind::Redis,
    ];
    let sqlite_kinds = [LockKind::Local, LockKind::Table, LockKind::Row];
    println!("\n| comparison | freshlock | baseline | ratio | goal |\n|---|---|---|---|---|");
    cached_load().await;
    single_task("SQLite", "sqlite::memory:", &sqlite_kinds, None).await;
    if let Some(url) = postgres {
        single_task("PostgreSQL", url, &pg_kinds, redis).await;
    }
    if let Some(url) = mysql {
        single_task("MariaDB", url, &my_kinds, redis).await;
    }
    memory().await;

    println!(
        "\n| database | backend | 1 task (ops/s) | 4 tasks | 16 tasks | 16 vs 1 | handoff p50 / p99 | 16 tasks on 16 rows |\n|---|---|---|---|---|---|---|---|"
    );
    contention("SQLite", "sqlite::memory:", &sqlite_kinds, None).await;
    if let Some(url) = postgres {
        contention("PostgreSQL", url, &pg_kinds, redis).await;
    }
    if let Some(url) = mysql {
        contention("MariaDB", url, &my_kinds, redis).await;
    }
}

async fn seed_table() {
    let nodes = if quick() { 20 } else { 250 };
    let work = Duration::from_millis(if quick() { 2 } else { 10 });
    println!(
        "\n| the seed's workload ({} tasks, {:?} work) | wall | fields lost |\n|---|---|---|",
        nodes * 4,
        work
    );
    let mut walls = Vec::new();
    for mode in [Mode::Freshlock, Mode::NoLock, Mode::LockAroundWork] {
        let (wall, lost) = seed_workload(mode, nodes, work).await;
        println!("| {mode:?} | {:.0} ms | {lost} |", wall.as_secs_f64() * 1e3);
        walls.push(wall.as_secs_f64());
    }
    println!(
        "\nfreshlock vs no lock: {:.2}× (goal ≤ 1.1×); lock around the work vs freshlock: {:.1}× (goal ≥ 10×)",
        walls[0] / walls[1],
        walls[2] / walls[0]
    );
}
