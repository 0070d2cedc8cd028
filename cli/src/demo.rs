//! `freshlock demo`: both field reports reproduced, and the fix, with numbers.

use std::{
    collections::HashSet,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use comfy_table::{Cell, CellAlignment, Table, presets::NOTHING};
use freshlock::claim::Claims;
use freshlock::lock::{LocalLock, RowLock};
use freshlock::{LockBackend, LockKind, Session, jobs::Worker};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use migration::{Migrator, MigratorTrait};
use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend};
use serde::Serialize;
use workload::{django, drupal, percentile_ms};

/// The demo's settings.
pub struct Options {
    pub database_url: Option<String>,
    pub lock: LockKind,
    pub redis_url: Option<String>,
    pub nodes: i32,
    pub workers: usize,
    pub work_ms: (u64, u64),
    /// The Django tasks' heavy work, in ms.
    pub task_ms: (u64, u64),
    pub seed: u64,
    pub json: bool,
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

// ------------------------------------------------------------------------- report

/// The demo's `--json` output (and what the tables print).
#[derive(Serialize)]
struct Report {
    database: &'static str,
    lock: &'static str,
    scenarios: [Scenario; 2],
}

/// One field report's results: `{"name": "drupal", "strategies": [...]}`.
#[derive(Serialize)]
#[serde(tag = "name", content = "strategies", rename_all = "lowercase")]
enum Scenario {
    Drupal(Vec<DrupalRow>),
    Django(Vec<DjangoRow>),
}

/// One Drupal strategy's run.
#[derive(Serialize)]
struct DrupalRow {
    name: &'static str,
    expected_fields: u64,
    lost_fields: u64,
    wall_ms: u64,
    lock_wait_ms: u64,
}

/// One Django strategy's run.
#[derive(Serialize)]
struct DjangoRow {
    name: &'static str,
    tasks: u64,
    processed_twice: u64,
    wall_ms: u64,
    tasks_per_s: f64,
    /// From the start to each task's end, for the tasks of the other (not hot) Hams.
    other_p50_ms: f64,
    other_p99_ms: f64,
    /// The workers' time spent waiting for locks, summed.
    lock_wait_ms: u64,
    parent_p50_ms: f64,
    parent_p99_ms: f64,
    /// Times the hot Ham could not be locked without waiting (always 0 on SQLite, whose
    /// writers wait for the database instead).
    parent_refused: u32,
}

// ------------------------------------------------------------------------- drupal

/// The Drupal workload ([`workload::drupal`]): `--workers` workers per field kind, each with its
/// own session, each writing its field of every `--workers`th node.
async fn drupal(
    db: &DatabaseConnection,
    lock: &Arc<dyn LockBackend>,
    options: &Options,
    strategy: drupal::Strategy,
    progress: &MultiProgress,
) -> Result<DrupalRow, Box<dyn std::error::Error>> {
    drupal::seed(db, options.nodes).await?;
    let jobs = u64::from(options.nodes.unsigned_abs()) * 4;
    let bar = bar(progress, jobs, strategy.name());
    // The hand-made strategies' lock, one for all workers.
    let local = LocalLock::new();
    let started = Instant::now();
    let mut handles = Vec::new();
    for (k, field) in drupal::Field::ALL.into_iter().enumerate() {
        for w in 0..options.workers {
            // Each worker is a job runner with its own session (its own entity cache).
            let session = Session::builder(db.clone())
                .lock(Arc::clone(lock))
                .build()?;
            let (bar, local) = (bar.clone(), local.clone());
            // Seeded: `--seed` makes runs repeatable.
            let mut noise = fastrand::Rng::with_seed(options.seed ^ ((k * 131 + w) as u64 + 1));
            let (low, high) = options.work_ms;
            let (nodes, workers) = (options.nodes, options.workers);
            handles.push(tokio::spawn(async move {
                let mut waited = Duration::ZERO;
                for id in (1 + w as i32..=nodes).step_by(workers) {
                    let work = Duration::from_millis(noise.u64(low..=high));
                    waited += drupal::job(strategy, &session, &local, id, field, work).await?;
                    bar.inc(1);
                }
                Ok::<_, workload::Failure>(waited)
            }));
        }
    }
    let mut waited = Duration::ZERO;
    for handle in handles {
        waited += handle.await?.map_err(|e| e.to_string())?;
    }
    let wall_ms = started.elapsed().as_millis() as u64;
    bar.finish();
    Ok(DrupalRow {
        name: strategy.name(),
        expected_fields: jobs,
        lost_fields: drupal::lost_fields(db).await? as u64,
        wall_ms,
        lock_wait_ms: waited.as_millis() as u64,
    })
}

// ------------------------------------------------------------------------- django

/// The Django workload ([`workload::django`]): twice `--nodes` Spam tasks (every tenth
/// delivered twice) pulled by 8 workers, while another connection locks and updates the hot Ham.
/// Also returns how many tasks were processed twice.
async fn django(
    db: &DatabaseConnection,
    options: &Options,
    strategy: django::Strategy,
    progress: &MultiProgress,
) -> Result<DjangoRow, Box<dyn std::error::Error>> {
    let tasks = options.nodes * 2;
    django::seed(db, tasks).await?;
    let bar = bar(progress, tasks as u64, strategy.name());
    let queue = Arc::new(Mutex::new(django::deliveries(tasks)));
    let done: Arc<Mutex<Vec<(i32, Duration)>>> = Arc::default();
    let waited: Arc<Mutex<Duration>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let prober = tokio::spawn(django::probe_hot_ham(db.clone(), Arc::clone(&stop)));
    let backend: Arc<dyn LockBackend> = Arc::new(RowLock::new(db.clone()));
    let started = Instant::now();
    let mut handles = Vec::new();
    for w in 0..8 {
        let (queue, done, bar) = (Arc::clone(&queue), Arc::clone(&done), bar.clone());
        let waited = Arc::clone(&waited);
        let worker = django::Worker {
            db: db.clone(),
            session: Session::builder(db.clone())
                .lock(Arc::clone(&backend))
                .build()?,
            claims: Claims::new(db.clone()).with_label(format!("worker {w}")),
            work_ms: options.task_ms,
        };
        handles.push(tokio::spawn(async move {
            loop {
                let Some(id) = queue.lock().map_err(|_| "poisoned")?.pop() else {
                    break;
                };
                if let Some(wait) = django::task(strategy, &worker, id).await? {
                    done.lock()
                        .map_err(|_| "poisoned")?
                        .push((id, started.elapsed()));
                    *waited.lock().map_err(|_| "poisoned")? += wait;
                    bar.inc(1);
                }
            }
            Ok::<_, workload::Failure>(())
        }));
    }
    let (wall_ms, mut probes) = wait_for(handles, started, &stop, prober).await?;
    bar.finish();
    let done = done.lock().map_err(|_| "poisoned")?.clone();
    let unique: HashSet<_> = done.iter().map(|(id, _)| id).collect();
    let mut others = other_hams(&done);
    let lock_wait_ms = waited.lock().map_err(|_| "poisoned")?.as_millis() as u64;
    Ok(DjangoRow {
        name: strategy.name(),
        tasks: done.len() as u64,
        processed_twice: (done.len() - unique.len()) as u64,
        wall_ms,
        tasks_per_s: (done.len() as f64 / (wall_ms.max(1) as f64 / 1e3)).round(),
        other_p50_ms: percentile_ms(&mut others, 50),
        other_p99_ms: percentile_ms(&mut others, 99),
        lock_wait_ms,
        parent_p50_ms: percentile_ms(&mut probes.latencies, 50),
        parent_p99_ms: percentile_ms(&mut probes.latencies, 99),
        parent_refused: probes.refused,
    })
}

/// Waits for the workers, then stops the prober: the wall time in ms and what the prober saw.
async fn wait_for<T, E: std::fmt::Display>(
    handles: Vec<tokio::task::JoinHandle<Result<T, E>>>,
    started: Instant,
    stop: &AtomicBool,
    prober: tokio::task::JoinHandle<Result<django::Probes, sea_orm::DbErr>>,
) -> Result<(u64, django::Probes), Box<dyn std::error::Error>> {
    let finished = async {
        for handle in handles {
            handle.await?.map_err(|e| e.to_string())?;
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    }
    .await;
    let wall_ms = started.elapsed().as_millis() as u64;
    stop.store(true, Ordering::SeqCst);
    let probes = prober.await??;
    finished?;
    Ok((wall_ms, probes))
}

/// The ends of the tasks of the other (not hot) Hams, from the start.
fn other_hams(done: &[(i32, Duration)]) -> Vec<Duration> {
    (done.iter())
        .filter(|(spam, _)| django::ham_of(*spam) != 1)
        .map(|(_, at)| *at)
        .collect()
}

/// The Django workload as keyed jobs: every delivery enqueued as a job keyed by its Ham and
/// unique per Spam (a second delivery of a waiting Spam adds nothing), run by 8 workers that
/// skip a busy Ham instead of waiting for it. Each job is the report's shape: claimed under a
/// lease, its heavy work outside any transaction, a short finish fenced by the claim; nothing
/// locks the Ham's row.
async fn django_jobs(
    db: &DatabaseConnection,
    options: &Options,
    progress: &MultiProgress,
) -> Result<DjangoRow, Box<dyn std::error::Error>> {
    let tasks = options.nodes * 2;
    django::seed(db, tasks).await?;
    django::enqueue(db, tasks)
        .await
        .map_err(|e| e.to_string())?;
    let bar = bar(progress, tasks as u64, django::Strategy::KeyedJobs.name());
    let stop = Arc::new(AtomicBool::new(false));
    let prober = tokio::spawn(django::probe_hot_ham(db.clone(), Arc::clone(&stop)));
    let (processed, mut ends) = tokio::sync::mpsc::unbounded_channel();
    let task_ms = options.task_ms;
    let handlers = django::jobs(
        move |spam| tokio::time::sleep(django::heavy_work(spam, task_ms)),
        processed,
    );
    let started = Instant::now();
    let counted = {
        let bar = bar.clone();
        tokio::spawn(async move {
            let mut done = Vec::new();
            while let Some((spam, at)) = ends.recv().await {
                done.push((spam, at.into_std().duration_since(started)));
                bar.inc(1);
            }
            done
        })
    };
    let mut handles = Vec::new();
    for _ in 0..8 {
        // `run_until_idle` ends when nothing is due: the worker that runs the hot Ham's job
        // takes its next one, so the hot Ham keeps one worker to the end.
        let worker = Worker::new(Session::new(db.clone()), handlers.clone());
        handles.push(tokio::spawn(async move { worker.run_until_idle().await }));
    }
    drop(handlers);
    let (wall_ms, mut probes) = wait_for(handles, started, &stop, prober).await?;
    let done = counted.await?;
    bar.finish();
    let mut others = other_hams(&done);
    Ok(DjangoRow {
        name: django::Strategy::KeyedJobs.name(),
        tasks: django::done(db).await?,
        processed_twice: django::processed_twice(db).await?,
        wall_ms,
        tasks_per_s: (done.len() as f64 / (wall_ms.max(1) as f64 / 1e3)).round(),
        other_p50_ms: percentile_ms(&mut others, 50),
        other_p99_ms: percentile_ms(&mut others, 99),
        // A busy Ham is skipped, never waited for.
        lock_wait_ms: 0,
        parent_p50_ms: percentile_ms(&mut probes.latencies, 50),
        parent_p99_ms: percentile_ms(&mut probes.latencies, 99),
        parent_refused: probes.refused,
    })
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
    for strategy in [
        drupal::Strategy::Naive,
        drupal::Strategy::StaleReload,
        drupal::Strategy::Freshlock,
    ] {
        drupal_rows.push(drupal(db, &lock, options, strategy, &progress).await?);
    }
    let mut django_rows = Vec::new();
    for strategy in [django::Strategy::ParentRowLock, django::Strategy::LockRow] {
        django_rows.push(django(db, options, strategy, &progress).await?);
    }
    django_rows.push(django_jobs(db, options, &progress).await?);
    let fresh_lost = drupal_rows
        .iter()
        .find(|r| r.name == drupal::Strategy::Freshlock.name())
        .map_or(1, |r| r.lost_fields);
    // freshlock's two ways: nothing processed twice, every Spam done.
    let ours = [django::Strategy::LockRow, django::Strategy::KeyedJobs];
    let twice: u64 = ours
        .iter()
        .map(|s| {
            (django_rows.iter().find(|r| r.name == s.name())).map_or(1, |r| {
                r.processed_twice + u64::from(r.tasks != (options.nodes * 2) as u64)
            })
        })
        .sum();
    let report = Report {
        database,
        lock: options.lock.as_str(),
        scenarios: [Scenario::Drupal(drupal_rows), Scenario::Django(django_rows)],
    };
    if options.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_tables(&report, (options.nodes * 2) as u64);
    }
    Ok(fresh_lost == 0 && twice == 0)
}

/// A table with its header, numbers right-aligned after the first column.
fn table(header: &[&str], rows: Vec<Vec<String>>) -> Table {
    let mut table = Table::new();
    table
        .load_preset(NOTHING)
        .set_header(header.iter().map(Cell::new));
    for row in rows {
        table.add_row(row);
    }
    for column in table.column_iter_mut().skip(1) {
        column.set_cell_alignment(CellAlignment::Right);
    }
    table
}

/// The Drupal table's verdict: freshlock's lost fields beside the others'.
fn drupal_verdict(rows: &[DrupalRow]) -> String {
    let ours = drupal::Strategy::Freshlock.name();
    let others: Vec<String> = (rows.iter())
        .filter(|r| r.name != ours)
        .map(|r| format!("{} lost {}", r.name, r.lost_fields))
        .collect();
    let fresh = rows.iter().find(|r| r.name == ours);
    format!(
        "{ours}: {} of {} fields lost; {}.",
        fresh.map_or(0, |r| r.lost_fields),
        fresh.map_or(0, |r| r.expected_fields),
        others.join(", ")
    )
}

/// The Django table's verdict: freshlock's tasks done and done twice, the Ham updater's p99 per
/// strategy, and — when keyed jobs took longer than `lock-row` — why, and when to choose which.
fn django_verdict(rows: &[DjangoRow], tasks: u64) -> Vec<String> {
    let row = |s: django::Strategy| rows.iter().find(|r| r.name == s.name());
    let ours = [django::Strategy::LockRow, django::Strategy::KeyedJobs];
    let done: Vec<String> = (ours.iter())
        .filter_map(|s| row(*s))
        .map(|r| {
            format!(
                "{} {} of {tasks} done, {} twice",
                r.name, r.tasks, r.processed_twice
            )
        })
        .collect();
    let p99: Vec<String> = (rows.iter())
        .map(|r| match r.parent_refused {
            0 => format!("{} {:.0} ms", r.name, r.parent_p99_ms),
            n => format!("{} {:.0} ms (refused {n} times)", r.name, r.parent_p99_ms),
        })
        .collect();
    let mut lines = vec![
        format!("freshlock: {}.", done.join("; ")),
        format!("The Ham updater's p99: {}.", p99.join(", ")),
    ];
    if let (Some(rows), Some(jobs)) = (
        row(django::Strategy::LockRow),
        row(django::Strategy::KeyedJobs),
    ) && jobs.wall_ms > rows.wall_ms
    {
        lines.push(format!(
            "keyed-jobs took longer ({} ms against {} ms): a key runs one job at a time, so the hot \
             Ham's heavy work runs end to end,",
            jobs.wall_ms, rows.wall_ms
        ));
        lines.push(format!(
            "while the other Hams drain first (others p50 {:.0} against {:.0} ms). Choose keyed jobs \
             when a key's tasks must run one at a time, in order; lock-row when only their writes must.",
            jobs.other_p50_ms, rows.other_p50_ms
        ));
    }
    lines
}

fn print_tables(report: &Report, tasks: u64) {
    println!(
        "\nfreshlock demo — {}, lock backend: {}\n",
        report.database, report.lock
    );
    for scenario in &report.scenarios {
        match scenario {
            Scenario::Drupal(drupal_rows) => {
                println!("Drupal report: 4 workers write their own field of the same nodes");
                let rows = drupal_rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.name.to_owned(),
                            r.expected_fields.to_string(),
                            r.lost_fields.to_string(),
                            r.wall_ms.to_string(),
                            r.lock_wait_ms.to_string(),
                        ]
                    })
                    .collect();
                let header = ["strategy", "expected", "lost", "wall ms", "lock wait ms"];
                println!("{}", table(&header, rows));
                println!("  {}", drupal_verdict(drupal_rows));
            }
            Scenario::Django(django_rows) => {
                println!(
                    "\nDjango report: Spam tasks serialized per Ham while another connection locks and updates the hot Ham"
                );
                let rows = django_rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.name.to_owned(),
                            r.tasks.to_string(),
                            r.processed_twice.to_string(),
                            r.wall_ms.to_string(),
                            r.tasks_per_s.to_string(),
                            r.other_p50_ms.to_string(),
                            r.other_p99_ms.to_string(),
                            r.lock_wait_ms.to_string(),
                            r.parent_p50_ms.to_string(),
                            r.parent_p99_ms.to_string(),
                            r.parent_refused.to_string(),
                        ]
                    })
                    .collect();
                let header = [
                    "strategy",
                    "tasks",
                    "twice",
                    "wall ms",
                    "tasks/s",
                    "others p50 ms",
                    "others p99 ms",
                    "lock wait ms",
                    "Ham p50 ms",
                    "Ham p99 ms",
                    "Ham refused",
                ];
                println!("{}", table(&header, rows));
                for line in django_verdict(django_rows, tasks) {
                    println!("  {line}");
                }
            }
        }
    }
    if report.database == "sqlite" {
        println!(
            "  SQLite has no row locks: a writer holds the whole database (BEGIN IMMEDIATE), so\n  \
             parent-row-lock's transaction around the heavy work stalls every writer, the Ham updater\n  \
             included. On PostgreSQL and MariaDB (--database-url) it locks the Ham row: Ham refused."
        );
    }
    println!();
}
