//! `freshlock` — the lock inspector.
//!
//! ```text
//! freshlock --database-url URL locks [--expired] [--json]
//! freshlock --database-url URL release --stale [--json]
//! ```
//!
//! It reads freshlock's `freshlock_lock` table (the `table` backend's leases). Expiry is judged by
//! the database clock; `release --stale` re-checks it in the clearing statement, so a live lease
//! is never cleared.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use freshlock::inspect::{self, HeldLock};
use sea_orm::{ConnectOptions, Database};

#[derive(Parser, Debug)]
#[command(
    name = "freshlock",
    version,
    about = "Inspect and clear freshlock's leases"
)]
struct Cli {
    /// The database holding `freshlock_lock` (SQLite, PostgreSQL or MySQL/MariaDB URL).
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
    /// List held leases: name, holder host / pid / label, acquired, expires, fence.
    Locks {
        /// Only leases that have run out (their holder died or stalled).
        #[arg(long)]
        expired: bool,
    },
    /// Clear leases.
    Release {
        /// Clear the leases that have run out (required: live leases are never cleared).
        #[arg(long, required = true)]
        stale: bool,
    },
}

fn to_json(lock: &HeldLock) -> serde_json::Value {
    serde_json::json!({
        "name": lock.name,
        "host": lock.host,
        "pid": lock.pid,
        "label": lock.label,
        "acquired_at_ms": lock.acquired_at_ms,
        "expires_at_ms": lock.expires_at_ms,
        "fence": lock.fence,
        "expired": lock.expired,
    })
}

async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let url = cli
        .database_url
        .ok_or("no database: pass --database-url or set DATABASE_URL")?;
    let mut options = ConnectOptions::new(url);
    options.max_connections(1).sqlx_logging(false);
    let db = Database::connect(options).await?;
    match cli.command {
        Command::Locks { expired } => {
            let locks = inspect::held_locks(&db, expired).await?;
            if cli.json {
                let list: Vec<_> = locks.iter().map(to_json).collect();
                println!("{}", serde_json::json!({ "locks": list }));
            } else {
                println!(
                    "{:<40} {:<20} {:>8} {:<16} {:>15} {:>15} {:>6} STATE",
                    "NAME", "HOST", "PID", "LABEL", "ACQUIRED_MS", "EXPIRES_MS", "FENCE"
                );
                for l in &locks {
                    println!(
                        "{:<40} {:<20} {:>8} {:<16} {:>15} {:>15} {:>6} {}",
                        l.name,
                        l.host.as_deref().unwrap_or("-"),
                        l.pid.map_or("-".into(), |p| p.to_string()),
                        l.label.as_deref().unwrap_or("-"),
                        l.acquired_at_ms.map_or("-".into(), |a| a.to_string()),
                        l.expires_at_ms,
                        l.fence,
                        if l.expired { "expired" } else { "held" }
                    );
                }
            }
        }
        Command::Release { stale: _ } => {
            let cleared = inspect::release_stale(&db).await?;
            if cli.json {
                println!("{}", serde_json::json!({ "released": cleared }));
            } else {
                println!("released {cleared} expired lease(s)");
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("freshlock: {e}");
            ExitCode::FAILURE
        }
    }
}
