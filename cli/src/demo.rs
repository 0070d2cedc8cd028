//! `freshlock demo`: both field reports reproduced, and the fix, with numbers.

use std::{
    collections::HashSet,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use entity::{ham, node, spam};
use freshlock::{
    ClaimOutcome, Claims, FinishOutcome, LeaseLock, LocalLock, LockBackend, LockKind, LockName,
    RowLock, Session, lock_name,
};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use migration::{Migrator, MigratorTrait};
use sea_orm::{
    ActiveModelTrait, ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend,
    EntityTrait, IntoActiveModel, QuerySelect, Set, TransactionTrait,
};
use serde_json::{Value as Json, json};

/// The demo's settings.
pub struct Options {
    pub database_url: Option<String>,
    pub lock: LockKind,
    pub redis_url: Option<String>,
    pub nodes: i32,
    pub workers: usize,
    pub work_ms: (u64, u64),
    pub seed: u64,
    pub json: bool,
}

const FIELDS: [&str; 4] = ["thumbnail", "summary", "score", "analysis"];

fn set_field(n: &mut node::ActiveModel, field: &str, id: i32) {
    let value = Some(format!("{field} of node {id}"));
    match field {
        "thumbnail" => n.thumbnail = Set(value),
        "summary" => n.summary = Set(value),
        "score" => n.score = Set(Some(id)),
        _ => n.analysis = Set(value),
    }
}

async fn connect(
    url: &str,
    schema: Option<&str>,
) -> Result<DatabaseConnection, Box<dyn std::error::Error>> {
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(16)
        .connect_timeout(Duration::from_secs(5))
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    if let Some(schema) = schema {
        options.set_schema_search_path(schema);
    }
    if url.starts_with("sqlite:") {
        let file = url
            .trim_start_matches("sqlite://")
            .split('?')
            .next()
            .unwrap_or("")
            .to_owned();
        options.map_sqlx_sqlite_opts(move |o| {
            o.filename(&file)
                .create_if_missing(true)
                .journal_mode(sea_orm::sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(30))
        });
    }
    let db = Database::connect(options).await?;
    Migrator::up(&db, None).await?;
    Ok(db)
}

/// Where the demo runs: a place of its own that it creates and removes, so it never reads or
/// writes an application's tables (`node`, `freshlock_claim`, …) even on the application's server.
struct Space {
    /// The demo's URL (for backends that open their own connections).
    url: String,
    db: DatabaseConnection,
    /// What to remove afterwards.
    made: Made,
}

enum Made {
    /// A temporary SQLite file's directory.
    Dir(std::path::PathBuf),
    /// A PostgreSQL schema of its own (the demo's connections have it as their search path).
    Schema(DatabaseConnection, String),
    /// A MySQL/MariaDB database of its own.
    Database(DatabaseConnection, String),
}

impl Space {
    /// A fresh space on the server at `url`; a temporary SQLite file without one (or for a
    /// SQLite URL: an application's SQLite file is never written).
    async fn create(url: Option<&str>) -> Result<Self, Box<dyn std::error::Error>> {
        let name = format!(
            "freshlock_demo_{}_{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_micros())
        );
        let server = url.filter(|url| !url.starts_with("sqlite:"));
        let Some(server) = server else {
            let dir = std::env::temp_dir().join(&name);
            std::fs::create_dir_all(&dir)?;
            let url = format!("sqlite://{}", dir.join("demo.db").display());
            let db = connect(&url, None).await?;
            return Ok(Self {
                url,
                db,
                made: Made::Dir(dir),
            });
        };
        let mut admin = ConnectOptions::new(server);
        admin
            .max_connections(1)
            .connect_timeout(Duration::from_secs(5))
            .acquire_timeout(Duration::from_secs(10))
            .sqlx_logging(false);
        let admin = Database::connect(admin).await?;
        match admin.get_database_backend() {
            DbBackend::Postgres => {
                admin
                    .execute_unprepared(&format!("CREATE SCHEMA \"{name}\""))
                    .await?;
                let db = connect(server, Some(&name)).await?;
                Ok(Self {
                    url: server.to_owned(),
                    db,
                    made: Made::Schema(admin, name),
                })
            }
            _ => {
                admin
                    .execute_unprepared(&format!(
                        "CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
                    ))
                    .await?;
                let (root, query) = match server.split_once('?') {
                    Some((root, query)) => (root, format!("?{query}")),
                    None => (server, String::new()),
                };
                let base = root.rsplit_once('/').map_or(root, |(base, _)| base);
                let url = format!("{base}/{name}{query}");
                let db = connect(&url, None).await?;
                Ok(Self {
                    url,
                    db,
                    made: Made::Database(admin, name),
                })
            }
        }
    }

    /// Removes what [`create`](Self::create) made.
    async fn remove(self) -> Result<(), Box<dyn std::error::Error>> {
        self.db.close().await?;
        match self.made {
            Made::Dir(dir) => std::fs::remove_dir_all(dir)?,
            Made::Schema(admin, name) => {
                admin
                    .execute_unprepared(&format!("DROP SCHEMA \"{name}\" CASCADE"))
                    .await?;
            }
            Made::Database(admin, name) => {
                admin
                    .execute_unprepared(&format!("DROP DATABASE `{name}`"))
                    .await?;
            }
        }
        Ok(())
    }
}

fn bar(progress: &MultiProgress, len: u64, label: &str) -> ProgressBar {
    let bar = progress.add(ProgressBar::new(len));
    bar.set_style(
        ProgressStyle::with_template("{prefix:>28} [{bar:30}] {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(label.to_owned());
    bar
}

// ------------------------------------------------------------------------- drupal

#[derive(Copy, Clone, Debug, PartialEq)]
enum Drupal {
    Naive,
    StaleReload,
    Freshlock,
}

impl Drupal {
    fn name(self) -> &'static str {
        match self {
            Self::Naive => "naive",
            Self::StaleReload => "stale-reload",
            Self::Freshlock => "freshlock",
        }
    }
}

async fn reset_nodes(db: &DatabaseConnection, nodes: i32) -> Result<(), sea_orm::DbErr> {
    node::Entity::delete_many().exec(db).await?;
    let rows: Vec<_> = (1..=nodes).map(node::ActiveModel::fresh).collect();
    for chunk in rows.chunks(500) {
        node::Entity::insert_many(chunk.to_vec()).exec(db).await?;
    }
    Ok(())
}

async fn drupal(
    db: &DatabaseConnection,
    lock: &Arc<dyn LockBackend>,
    options: &Options,
    strategy: Drupal,
    progress: &MultiProgress,
) -> Result<Json, Box<dyn std::error::Error>> {
    reset_nodes(db, options.nodes).await?;
    let bar = bar(
        progress,
        u64::from(options.nodes as u32) * 4 * options.workers as u64,
        strategy.name(),
    );
    let waits = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut handles = Vec::new();
    for (k, field) in FIELDS.into_iter().enumerate() {
        for w in 0..options.workers {
            // Each worker is a job with its own session (its own entity cache).
            let session = Session::builder(db.clone())
                .lock(Arc::clone(lock))
                .build()?;
            let (bar, waits) = (bar.clone(), Arc::clone(&waits));
            // Seeded: `--seed` makes runs repeatable.
            let mut noise = fastrand::Rng::with_seed(options.seed ^ ((k * 131 + w) as u64 + 1));
            let (low, high) = options.work_ms;
            let (nodes, workers) = (options.nodes, options.workers as i32);
            let local = LocalLock::new();
            handles.push(tokio::spawn(async move {
                let repo = session.repository::<node::Entity>();
                for id in (1 + w as i32..=nodes).step_by(workers as usize) {
                    // ① load (cached in the session) ② heavy work ③ save.
                    let loaded = repo.load(id).await?.ok_or("node vanished")?;
                    tokio::time::sleep(Duration::from_millis(noise.u64(low..=high))).await;
                    match strategy {
                        Drupal::Naive => {
                            let mut whole = (*loaded).clone().into_active_model().reset_all();
                            set_field(&mut whole, field, id);
                            whole.update(session.connection()).await?;
                        }
                        Drupal::StaleReload => {
                            // The report's first fix: lock, "reload" (from the cache), save all.
                            let name = LockName::new(format!("node:{id}"))?;
                            let t = Instant::now();
                            let guard = local
                                .acquire(&name, Duration::from_secs(30), Duration::from_secs(60))
                                .await?;
                            waits.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                            let reloaded = repo.load(id).await?.ok_or("node vanished")?;
                            let mut whole = (*reloaded).clone().into_active_model().reset_all();
                            set_field(&mut whole, field, id);
                            whole.update(session.connection()).await?;
                            if let Some(guard) = guard {
                                guard.release().await?;
                            }
                        }
                        Drupal::Freshlock => {
                            let report = repo
                                .locked_update(id, |n| {
                                    set_field(n, field, id);
                                    Ok(())
                                })
                                .await?;
                            waits.fetch_add(
                                report.lock.waited.as_micros() as u64,
                                Ordering::Relaxed,
                            );
                        }
                    }
                    bar.inc(1);
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            }));
        }
    }
    for handle in handles {
        handle.await?.map_err(|e| e.to_string())?;
    }
    let wall_ms = started.elapsed().as_millis() as u64;
    bar.finish();
    let mut lost = 0u64;
    for row in node::Entity::find().all(db).await? {
        lost += [
            row.thumbnail.is_none(),
            row.summary.is_none(),
            row.score.is_none(),
            row.analysis.is_none(),
        ]
        .into_iter()
        .filter(|&missing| missing)
        .count() as u64;
    }
    Ok(json!({
        "name": strategy.name(),
        "expected_fields": options.nodes as u64 * 4,
        "lost_fields": lost,
        "wall_ms": wall_ms,
        "lock_wait_ms": waits.load(Ordering::Relaxed) / 1000,
    }))
}

// ------------------------------------------------------------------------- django

#[derive(Copy, Clone, Debug, PartialEq)]
enum Django {
    ParentRowLock,
    LockRow,
}

impl Django {
    fn name(self) -> &'static str {
        match self {
            Self::ParentRowLock => "parent-row-lock",
            Self::LockRow => "lock-row",
        }
    }
}

async fn reset_spams(db: &DatabaseConnection, tasks: i32) -> Result<(), sea_orm::DbErr> {
    db.execute_unprepared("DELETE FROM spam").await?;
    db.execute_unprepared("DELETE FROM ham_lock").await?;
    db.execute_unprepared("DELETE FROM ham").await?;
    db.execute_unprepared("DELETE FROM freshlock_claim").await?;
    let hams: Vec<_> = (1..=20)
        .map(|id| ham::ActiveModel {
            id: Set(id),
            name: Set(format!("ham {id}")),
            updated_at: Set(0),
        })
        .collect();
    ham::Entity::insert_many(hams).exec(db).await?;
    let spams: Vec<_> = (1..=tasks)
        .map(|id| spam::ActiveModel {
            id: Set(id),
            ham_id: Set(if id % 2 == 0 { 1 } else { 2 + id % 19 }),
            state: Set("new".into()),
            updated_at: Set(0),
        })
        .collect();
    for chunk in spams.chunks(500) {
        spam::Entity::insert_many(chunk.to_vec()).exec(db).await?;
    }
    Ok(())
}

fn percentile(samples: &mut [Duration], p: usize) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort();
    samples[(samples.len() * p / 100).min(samples.len() - 1)].as_secs_f64() * 1e3
}

async fn django(
    db: &DatabaseConnection,
    options: &Options,
    strategy: Django,
    progress: &MultiProgress,
) -> Result<(Json, u64), Box<dyn std::error::Error>> {
    let tasks = options.nodes * 2;
    reset_spams(db, tasks).await?;
    let bar = bar(progress, tasks as u64, strategy.name());
    let queue = Arc::new(Mutex::new(
        (1..=tasks)
            .chain((1..=tasks).step_by(10))
            .collect::<Vec<_>>(),
    ));
    let done: Arc<Mutex<Vec<i32>>> = Arc::default();
    // Another connection reads and updates Ham rows meanwhile.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = {
        let (db, stop) = (db.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut id = 0;
            while !stop.load(Ordering::SeqCst) {
                id = id % 20 + 1;
                let t = Instant::now();
                let _ = ham::Entity::find_by_id(id).one(&db).await;
                let _ = ham::Entity::update(ham::ActiveModel {
                    id: Set(id),
                    updated_at: Set(1),
                    ..Default::default()
                })
                .exec(&db)
                .await;
                latencies.push(t.elapsed());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            latencies
        })
    };
    let backend: Arc<dyn LockBackend> = Arc::new(RowLock::new(db.clone()));
    let started = Instant::now();
    let mut handles = Vec::new();
    for w in 0..8u64 {
        let (db, queue, done, bar, backend) = (
            db.clone(),
            Arc::clone(&queue),
            Arc::clone(&done),
            bar.clone(),
            Arc::clone(&backend),
        );
        let mut noise = fastrand::Rng::with_seed(options.seed ^ (w + 1000));
        handles.push(tokio::spawn(async move {
            let session = Session::builder(db.clone()).lock(backend).build()?;
            let claims = Claims::new(db.clone()).with_label(format!("worker {w}"));
            let spams = session.repository::<spam::Entity>();
            loop {
                let Some(id) = queue.lock().map_err(|_| "poisoned")?.pop() else {
                    break;
                };
                let work = Duration::from_millis(noise.u64(1..=5));
                match strategy {
                    Django::ParentRowLock => {
                        // SQLite: a deferred transaction that reads then writes fails at once
                        // with "database is locked"; writers must begin IMMEDIATE.
                        let txn = if db.get_database_backend() == DbBackend::Sqlite {
                            db.begin_with_options(sea_orm::TransactionOptions {
                                sqlite_transaction_mode: Some(
                                    sea_orm::SqliteTransactionMode::Immediate,
                                ),
                                ..Default::default()
                            })
                            .await?
                        } else {
                            db.begin().await?
                        };
                        let Some(spam) = spam::Entity::find_by_id(id).one(&txn).await? else {
                            continue;
                        };
                        if spam.state != "new" {
                            txn.rollback().await?;
                            continue;
                        }
                        ham::Entity::find_by_id(spam.ham_id)
                            .lock_exclusive()
                            .one(&txn)
                            .await?;
                        tokio::time::sleep(work).await; // the report's long transaction
                        spam::Entity::update(spam::ActiveModel {
                            id: Set(id),
                            state: Set("done".into()),
                            ..Default::default()
                        })
                        .exec(&txn)
                        .await?;
                        txn.commit().await?;
                    }
                    Django::LockRow => {
                        let task = LockName::new(format!("spam-task:{id}"))?;
                        let ClaimOutcome::Claimed(claim) =
                            claims.claim(&task, Duration::from_secs(60)).await?
                        else {
                            continue; // done already, or claimed by a live worker: processed once
                        };
                        let ham_id = spams.load(id).await?.ok_or("spam vanished")?.ham_id;
                        let key = lock_name::<ham::Entity>(ham_id)?;
                        spams
                            .locked_update_under(key.clone(), id, |s| {
                                s.state = Set("processing".into());
                                Ok(())
                            })
                            .await?;
                        tokio::time::sleep(work).await; // heavy work: no transaction, no lock
                        spams
                            .locked_update_under(key, id, |s| {
                                s.state = Set("done".into());
                                Ok(())
                            })
                            .await?;
                        if claims.finish(&claim).await? != FinishOutcome::Finished {
                            return Err("a claim was lost".into());
                        }
                    }
                }
                done.lock().map_err(|_| "poisoned")?.push(id);
                bar.inc(1);
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }));
    }
    for handle in handles {
        handle.await?.map_err(|e| e.to_string())?;
    }
    let wall_ms = started.elapsed().as_millis() as u64;
    stop.store(true, Ordering::SeqCst);
    let mut latencies = prober.await?;
    bar.finish();
    let done = done.lock().map_err(|_| "poisoned")?.clone();
    let unique: HashSet<_> = done.iter().collect();
    let twice = (done.len() - unique.len()) as u64;
    Ok((
        json!({
            "name": strategy.name(),
            "tasks": done.len(),
            "processed_twice": twice,
            "wall_ms": wall_ms,
            "tasks_per_s": (done.len() as f64 / (wall_ms.max(1) as f64 / 1e3)).round(),
            "parent_p50_ms": (percentile(&mut latencies, 50) * 100.0).round() / 100.0,
            "parent_p99_ms": (percentile(&mut latencies, 99) * 100.0).round() / 100.0,
        }),
        twice,
    ))
}

// ------------------------------------------------------------------------- run

/// Runs both scenarios; returns whether freshlock lost nothing and processed nothing twice.
pub async fn run(options: Options) -> Result<bool, Box<dyn std::error::Error>> {
    let space = Space::create(options.database_url.as_deref()).await?;
    let result = scenarios(&space, &options).await;
    let removed = space.remove().await;
    let ok = result?;
    removed?;
    Ok(ok)
}

async fn scenarios(space: &Space, options: &Options) -> Result<bool, Box<dyn std::error::Error>> {
    let db = &space.db;
    let database = match db.get_database_backend() {
        DbBackend::Postgres => "postgres",
        DbBackend::MySql => "mysql",
        _ => "sqlite",
    };
    let lock = options
        .lock
        .connect(db, &space.url, options.redis_url.as_deref())
        .await?;
    let progress = if options.json {
        MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden())
    } else {
        MultiProgress::new()
    };

    let mut drupal_rows = Vec::new();
    for strategy in [Drupal::Naive, Drupal::StaleReload, Drupal::Freshlock] {
        drupal_rows.push(drupal(db, &lock, options, strategy, &progress).await?);
    }
    let mut django_rows = Vec::new();
    let mut twice = 0;
    for strategy in [Django::ParentRowLock, Django::LockRow] {
        let (row, dup) = django(db, options, strategy, &progress).await?;
        if strategy == Django::LockRow {
            twice = dup;
        }
        django_rows.push(row);
    }
    let fresh_lost = drupal_rows
        .iter()
        .find(|r| r["name"] == "freshlock")
        .map_or(1, |r| r["lost_fields"].as_u64().unwrap_or(1));
    let report = json!({
        "database": database,
        "lock": options.lock.as_str(),
        "scenarios": [
            {"name": "drupal", "strategies": drupal_rows},
            {"name": "django", "strategies": django_rows},
        ],
    });
    if options.json {
        println!("{report}");
    } else {
        print_table(&report, database);
    }
    Ok(fresh_lost == 0 && twice == 0)
}

/// A JSON value as plain text (strings unquoted), so that column widths apply.
fn cell(value: &Json) -> String {
    match value {
        Json::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn print_table(report: &Json, database: &str) {
    let empty = Vec::new();
    let scenarios = report["scenarios"].as_array().unwrap_or(&empty);
    println!(
        "\nfreshlock demo — {database}, lock backend: {}\n",
        report["lock"].as_str().unwrap_or("?")
    );
    println!("Drupal report: 4 workers write their own field of the same nodes");
    println!(
        "  {:<14} {:>9} {:>7} {:>9} {:>12}",
        "strategy", "expected", "lost", "wall ms", "lock wait ms"
    );
    for s in scenarios[0]["strategies"].as_array().unwrap_or(&empty) {
        println!(
            "  {:<14} {:>9} {:>7} {:>9} {:>12}",
            cell(&s["name"]),
            cell(&s["expected_fields"]),
            cell(&s["lost_fields"]),
            cell(&s["wall_ms"]),
            cell(&s["lock_wait_ms"])
        );
    }
    println!(
        "\nDjango report: Spam tasks serialized per Ham while others read and update the Hams"
    );
    println!(
        "  {:<16} {:>6} {:>8} {:>9} {:>8} {:>13} {:>13}",
        "strategy", "tasks", "twice", "wall ms", "tasks/s", "Ham p50 ms", "Ham p99 ms"
    );
    for s in scenarios[1]["strategies"].as_array().unwrap_or(&empty) {
        println!(
            "  {:<16} {:>6} {:>8} {:>9} {:>8} {:>13} {:>13}",
            cell(&s["name"]),
            cell(&s["tasks"]),
            cell(&s["processed_twice"]),
            cell(&s["wall_ms"]),
            cell(&s["tasks_per_s"]),
            cell(&s["parent_p50_ms"]),
            cell(&s["parent_p99_ms"])
        );
    }
    if database == "sqlite" {
        println!(
            "\n  SQLite has no row locks: one writer at a time holds the whole database (BEGIN IMMEDIATE)."
        );
        println!(
            "  parent-row-lock keeps its transaction open around the heavy work, so it stalls every"
        );
        println!(
            "  writer, the Ham updater included; lock-row keeps the work outside any transaction. On"
        );
        println!(
            "  PostgreSQL and MariaDB (--database-url) the Ham row itself is what parent-row-lock blocks."
        );
    }
    println!();
}
