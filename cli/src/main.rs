//! `freshlock` — the demo and the lock inspector.
//!
//! ```text
//! freshlock demo [--database-url URL] [--lock KIND] [--nodes N] [--workers N] [--work-ms A-B] [--task-ms A-B] [--seed S] [--json]
//! freshlock --database-url URL locks [--expired] [--json]
//! freshlock --database-url URL release [--stale] [--compact [--idle-secs N]] [--json]
//! ```
//!
//! It reads freshlock's `freshlock_lock` table (the `table` backend's leases). Expiry is judged by
//! the database clock; `release --stale` re-checks it in the clearing statement, so a live lease
//! is never cleared. `release --compact` deletes the lock rows nobody needs, keeping every
//! name's fences growing (`freshlock::inspect::compact`).

use std::{process::ExitCode, time::Duration};

mod demo;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, parser::ValueSource};
use comfy_table::{CellAlignment, Table, presets::NOTHING};
use freshlock::inspect::{self, HeldLock};
use sea_orm::{ConnectOptions, Database};
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(
    name = "freshlock",
    version,
    about = "Inspect and clear freshlock's leases and jobs; run the field reports' demo"
)]
struct Cli {
    /// The database holding `freshlock_lock` (SQLite, PostgreSQL or MySQL/MariaDB URL). For
    /// `locks` and `release` it may come from `DATABASE_URL`; the demo never reads that variable
    /// and never touches the database's own tables (it works in a schema or database of its own).
    #[arg(long, env = "DATABASE_URL", global = true)]
    database_url: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Reproduce both field reports and the fix: lost fields, wall time, Ham latency.
    Demo {
        /// The lock backend: local, table, row, pg_advisory, mysql_named, redis.
        #[arg(long, default_value = "local")]
        lock: freshlock::LockKind,
        /// Needed by `--lock redis`.
        #[arg(long, env = "REDIS_URL")]
        redis_url: Option<String>,
        /// Nodes per run (the Django scenario runs twice as many Spam tasks).
        #[arg(long, default_value_t = 100)]
        nodes: i32,
        /// Workers per field kind.
        #[arg(long, default_value_t = 1)]
        workers: usize,
        /// Simulated heavy work per task, in ms (the report's 15–60 s, scaled down).
        #[arg(long, default_value = "15-60", value_parser = parse_range)]
        work_ms: (u64, u64),
        /// The Django tasks' heavy work, in ms (the shape of the report's skew: 10–30 ms).
        #[arg(long, default_value = "10-30", value_parser = parse_range)]
        task_ms: (u64, u64),
        /// Seed of the simulated work times (reproducible runs).
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
    /// List held leases: name, holder host / pid / label, acquired, expires, fence.
    Locks {
        /// Only leases that have run out (their holder died or stalled).
        #[arg(long)]
        expired: bool,
    },
    /// The job queue (`freshlock::jobs`): its depth per kind and key; `list`, `retry`,
    /// `discard`, `cancel` for single jobs; `prune` for finished ones.
    Jobs {
        #[command(subcommand)]
        action: Option<JobsAction>,
    },
    /// Clear leases that have run out, and delete lock rows nobody needs (live leases are
    /// never touched).
    #[command(group = clap::ArgGroup::new("what").required(true).multiple(true).args(["stale", "compact"]))]
    Release {
        /// Clear the leases that have run out.
        #[arg(long)]
        stale: bool,
        /// Delete the lock rows nobody holds that were last granted `--idle-secs` ago or
        /// earlier, raising the fence floor so every name's fences keep growing; and the `row`
        /// backend's lock rows no transaction holds. After `--stale` when both are given.
        #[arg(long)]
        compact: bool,
        /// With `--compact`: how long a row must have been idle, in seconds.
        #[arg(long, default_value_t = 600, requires = "compact")]
        idle_secs: u64,
    },
}

#[derive(Subcommand, Debug)]
enum JobsAction {
    /// The jobs in one state, oldest first.
    List {
        /// waiting, leased, done, failed, discarded or cancelled.
        #[arg(long, default_value = "failed", value_parser = parse_state)]
        state: freshlock::jobs::JobState,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u64,
        /// Only jobs of this kind.
        #[arg(long)]
        kind: Option<String>,
        /// Only jobs of this serialization key.
        #[arg(long)]
        key: Option<String>,
    },
    /// Make a failed job wait again, due now, its attempts counted from zero.
    Retry {
        /// The job's id.
        id: i64,
    },
    /// Discard a waiting job before it runs.
    Discard {
        /// The job's id.
        id: i64,
    },
    /// Cancel a job: at once when it waits or is leased (its finish is refused); a job running
    /// in a worker's transaction is asked to stop, rolled back and not run again.
    Cancel {
        /// The job's id.
        id: i64,
    },
    /// Delete done, discarded and cancelled jobs (and failed ones with `--failed`) that finished
    /// `--older-than` ago or earlier (`0s`: all of them); waiting and leased jobs are never
    /// touched.
    Prune {
        /// How long ago: a number and a unit, `s`, `m`, `h` or `d` (`7d`, `12h`, `0s`).
        #[arg(long, value_parser = parse_age)]
        older_than: std::time::Duration,
        /// Delete failed jobs too (their errors go with them).
        #[arg(long)]
        failed: bool,
    },
}

/// `7d`, `12h`, `30m`, `45s`: a whole number and its unit.
fn parse_age(text: &str) -> Result<std::time::Duration, String> {
    let bad = || format!("{text:?}: expected a whole number and s, m, h or d (7d, 12h, 30m, 45s)");
    let split = text.len().checked_sub(1).ok_or_else(bad)?;
    let (number, unit) = text.split_at_checked(split).ok_or_else(bad)?;
    let number: u64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    number
        .checked_mul(seconds)
        .map(std::time::Duration::from_secs)
        .ok_or_else(bad)
}

fn parse_state(text: &str) -> Result<freshlock::jobs::JobState, String> {
    use freshlock::jobs::JobState;
    [
        JobState::Waiting,
        JobState::Leased,
        JobState::Done,
        JobState::Failed,
        JobState::Discarded,
        JobState::Cancelled,
    ]
    .into_iter()
    .find(|s| s.as_str() == text)
    .ok_or_else(|| {
        format!("{text:?}: expected waiting, leased, done, failed, discarded or cancelled")
    })
}

/// `jobs --json`: the depth per kind and key.
#[derive(Serialize)]
struct DepthRow<'a> {
    kind: &'a str,
    key: Option<&'a str>,
    waiting: u64,
    due: u64,
    failed: u64,
    /// Whether a running worker takes the kind (false: its jobs wait for one).
    handled: bool,
}

/// `jobs list --json`: one job.
#[derive(Serialize)]
struct JobRow<'a> {
    id: i64,
    kind: &'a str,
    key: Option<&'a str>,
    unique: Option<&'a str>,
    state: &'static str,
    attempts: i32,
    priority: i32,
    run_at_ms: i64,
    created_at_ms: i64,
    finished_at_ms: Option<i64>,
    last_error: Option<&'a str>,
}

/// `locks --json`: `{"locks": [...]}`.
#[derive(Serialize)]
struct Locks<'a> {
    locks: Vec<LockRow<'a>>,
}

/// One held lease, as `locks --json` prints it.
#[derive(Serialize)]
struct LockRow<'a> {
    name: &'a str,
    host: Option<&'a str>,
    pid: Option<i64>,
    label: Option<&'a str>,
    acquired_at_ms: Option<i64>,
    expires_at_ms: i64,
    fence: i64,
    expired: bool,
}

impl<'a> From<&'a HeldLock> for LockRow<'a> {
    fn from(lock: &'a HeldLock) -> Self {
        Self {
            name: &lock.name,
            host: lock.host.as_deref(),
            pid: lock.pid,
            label: lock.label.as_deref(),
            acquired_at_ms: lock.acquired_at_ms,
            expires_at_ms: lock.expires_at_ms,
            fence: lock.fence,
            expired: lock.expired,
        }
    }
}

/// `release --json`: what was cleared and deleted (a part absent when not asked for).
#[derive(Serialize, Default)]
struct Released {
    #[serde(skip_serializing_if = "Option::is_none")]
    released: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted_lock_rows: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted_row_lock_rows: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fence_floor: Option<i64>,
}

/// The held leases as a table.
fn locks_table(locks: &[HeldLock]) -> Table {
    let mut table = Table::new();
    table.load_preset(NOTHING).set_header([
        "NAME",
        "HOST",
        "PID",
        "LABEL",
        "ACQUIRED_MS",
        "EXPIRES_MS",
        "FENCE",
        "STATE",
    ]);
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    for l in locks {
        table.add_row([
            l.name.clone(),
            or_dash(l.host.clone()),
            or_dash(l.pid.map(|p| p.to_string())),
            or_dash(l.label.clone()),
            or_dash(l.acquired_at_ms.map(|a| a.to_string())),
            l.expires_at_ms.to_string(),
            l.fence.to_string(),
            if l.expired { "expired" } else { "held" }.into(),
        ]);
    }
    for i in [2, 4, 5, 6] {
        if let Some(column) = table.column_mut(i) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    table
}

fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let (low, high) = s.split_once('-').unwrap_or((s, s));
    let low: u64 = low
        .trim()
        .parse()
        .map_err(|_| format!("not a range of ms: {s}"))?;
    let high: u64 = high
        .trim()
        .parse()
        .map_err(|_| format!("not a range of ms: {s}"))?;
    if low > high {
        return Err(format!("empty range: {s}"));
    }
    Ok((low, high))
}

async fn run(cli: Cli, url_from_env: bool) -> Result<(), Box<dyn std::error::Error>> {
    if let Command::Demo {
        lock,
        redis_url,
        nodes,
        workers,
        work_ms,
        task_ms,
        seed,
    } = cli.command
    {
        if nodes < 1 || workers < 1 {
            return Err("--nodes and --workers must be at least 1".into());
        }
        if lock == freshlock::LockKind::Redis && !cfg!(feature = "redis") {
            return Err("this freshlock was built without Redis support: \
                        cargo install --path cli --features redis"
                .into());
        }
        // An application's DATABASE_URL is not an invitation to run a demo in its database.
        let database_url = if url_from_env {
            eprintln!(
                "freshlock: the demo ignores DATABASE_URL; pass --database-url to run it on a \
                 server (in a schema or database of its own)"
            );
            None
        } else {
            cli.database_url
        };
        let options = demo::Options {
            database_url,
            lock,
            redis_url,
            nodes,
            workers,
            work_ms,
            task_ms,
            seed,
            json: cli.json,
        };
        if !demo::run(options).await? {
            return Err("freshlock lost a field or processed a task twice".into());
        }
        return Ok(());
    }
    let url = cli
        .database_url
        .ok_or("no database: pass --database-url or set DATABASE_URL")?;
    let db = connect(&url).await?;
    match cli.command {
        Command::Locks { expired } => {
            let which = if expired {
                inspect::Held::Expired
            } else {
                inspect::Held::All
            };
            let locks = inspect::held_locks(&db, which).await?;
            if cli.json {
                let locks = Locks {
                    locks: locks.iter().map(LockRow::from).collect(),
                };
                println!("{}", serde_json::to_string(&locks)?);
            } else {
                println!("{}", locks_table(&locks));
            }
        }
        Command::Demo { .. } => {}
        Command::Jobs { action } => jobs(&db, action, cli.json).await?,
        Command::Release {
            stale,
            compact,
            idle_secs,
        } => {
            let mut report = Released::default();
            if stale {
                let cleared = inspect::release_stale(&db).await?;
                report.released = Some(cleared);
                if !cli.json {
                    println!("released {cleared} expired lease(s)");
                }
            }
            if compact {
                let done = inspect::compact(&db, Duration::from_secs(idle_secs)).await?;
                report.deleted_lock_rows = Some(done.lock_rows);
                report.deleted_row_lock_rows = Some(done.row_lock_rows);
                report.fence_floor = Some(done.floor);
                if !cli.json {
                    println!(
                        "deleted {} lock row(s) and {} row-lock row(s); fence floor {}",
                        done.lock_rows, done.row_lock_rows, done.floor
                    );
                }
            }
            if cli.json {
                println!("{}", serde_json::to_string(&report)?);
            }
        }
    }
    Ok(())
}

/// `freshlock jobs …`.
async fn jobs(
    db: &sea_orm::DatabaseConnection,
    action: Option<JobsAction>,
    json: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    use freshlock::jobs;
    let or_dash = |v: Option<&str>| v.unwrap_or("-").to_owned();
    match action {
        None => {
            let depth = jobs::depth(db).await?;
            let rows: Vec<_> = (depth.iter())
                .map(|d| DepthRow {
                    kind: &d.kind,
                    key: d.key.as_deref(),
                    waiting: d.waiting,
                    due: d.due,
                    failed: d.failed,
                    handled: d.handled,
                })
                .collect();
            if json {
                println!("{}", serde_json::to_string(&rows)?);
                return Ok(());
            }
            let mut table = Table::new();
            table
                .load_preset(NOTHING)
                .set_header(["KIND", "KEY", "WAITING", "DUE", "FAILED", "WORKER"]);
            for r in &rows {
                table.add_row([
                    r.kind.to_owned(),
                    or_dash(r.key),
                    r.waiting.to_string(),
                    r.due.to_string(),
                    r.failed.to_string(),
                    (if r.handled { "yes" } else { "none" }).to_owned(),
                ]);
            }
            println!("{table}");
        }
        Some(JobsAction::List {
            state,
            limit,
            kind,
            key,
        }) => {
            let mut filter = jobs::JobFilter::new().state(state);
            if let Some(kind) = kind {
                filter = filter.kind(kind);
            }
            if let Some(key) = key {
                filter = filter.key(key);
            }
            let listed = filter.list(db, limit).await?;
            let rows: Vec<_> = (listed.iter())
                .map(|j| JobRow {
                    id: j.id,
                    kind: &j.kind,
                    key: j.key.as_deref(),
                    unique: j.unique.as_deref(),
                    state: j.state.as_str(),
                    attempts: j.attempts,
                    priority: j.priority,
                    run_at_ms: j.run_at_ms,
                    created_at_ms: j.created_at_ms,
                    finished_at_ms: j.finished_at_ms,
                    last_error: j.last_error.as_deref(),
                })
                .collect();
            if json {
                println!("{}", serde_json::to_string(&rows)?);
                return Ok(());
            }
            let mut table = Table::new();
            table.load_preset(NOTHING).set_header([
                "ID",
                "KIND",
                "KEY",
                "STATE",
                "ATTEMPTS",
                "RUN_AT_MS",
                "LAST_ERROR",
            ]);
            for r in &rows {
                table.add_row([
                    r.id.to_string(),
                    r.kind.to_owned(),
                    or_dash(r.key),
                    r.state.to_owned(),
                    r.attempts.to_string(),
                    r.run_at_ms.to_string(),
                    or_dash(r.last_error),
                ]);
            }
            println!("{table}");
        }
        Some(JobsAction::Retry { id }) => {
            let said = match jobs::retry(db, id).await? {
                jobs::Retried::Waiting => "waiting again",
                jobs::Retried::Duplicate => {
                    return Err(format!(
                        "job {id} was left failed: another unfinished job holds its unique key"
                    )
                    .into());
                }
                _ => return Err(format!("no failed job has id {id}").into()),
            };
            println!("job {id}: {said}");
        }
        Some(JobsAction::Discard { id }) => {
            if !jobs::discard(db, id).await? {
                return Err(format!("no waiting job has id {id}").into());
            }
            println!("job {id}: discarded");
        }
        Some(JobsAction::Cancel { id }) => match jobs::cancel(db, id).await? {
            jobs::Cancel::Cancelled => println!("job {id}: cancelled"),
            jobs::Cancel::Requested => {
                println!("job {id}: running; asked to stop (it is rolled back when it returns)");
            }
            _ => return Err(format!("no unfinished job has id {id}").into()),
        },
        Some(JobsAction::Prune { older_than, failed }) => {
            let which = if failed {
                jobs::Prune::FinishedAndFailed
            } else {
                jobs::Prune::Finished
            };
            let pruned = jobs::prune(db, older_than, which).await?;
            if json {
                println!("{}", serde_json::json!({ "pruned": pruned }));
            } else {
                println!("pruned {pruned} finished jobs");
            }
        }
    }
    Ok(())
}

/// Connects to `url`. A pool that cannot connect only says "pool timed out" (after its acquire
/// timeout): one direct connection first gives the real cause (refused, unknown host, bad
/// password) at once.
async fn connect(url: &str) -> Result<sea_orm::DatabaseConnection, Box<dyn std::error::Error>> {
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    use sea_orm::sqlx::Connection;
    let probe = async {
        #[cfg(feature = "postgres")]
        if url.starts_with("postgres") {
            return sea_orm::sqlx::PgConnection::connect(url).await.map(drop);
        }
        #[cfg(feature = "mysql")]
        if url.starts_with("mysql") || url.starts_with("mariadb") {
            return sea_orm::sqlx::MySqlConnection::connect(url).await.map(drop);
        }
        let _ = url;
        Ok::<(), sea_orm::sqlx::Error>(())
    };
    match tokio::time::timeout(Duration::from_secs(5), probe).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("cannot connect to the database: {e}").into()),
        Err(_) => return Err("cannot connect to the database: no answer within 5 s".into()),
    }
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(1)
        .connect_timeout(Duration::from_secs(5))
        .acquire_timeout(Duration::from_secs(10))
        .sqlx_logging(false);
    Ok(Database::connect(options).await?)
}

/// The error and every cause below it, one per line, with a hint where one helps.
fn report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = format!("freshlock: {error}");
    let mut missing_table = false;
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!("\n  caused by: {cause}"));
        let said = cause.to_string();
        missing_table |= said.contains("no such table")
            || (said.contains("relation") && said.contains("does not exist"))
            || said.contains("doesn't exist");
        source = cause.source();
    }
    if missing_table {
        text.push_str(
            "\n  hint: freshlock's tables are missing here: run its migrations \
             (freshlock::schema::migrations(), part of your Migrator), or point --database-url \
             at the application's database",
        );
    }
    text
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let url_from_env = matches.value_source("database_url") == Some(ValueSource::EnvVariable);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("freshlock: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli, url_from_env)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", report(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
