//! `axum_service`: the example service on a SQLite file (or any database URL).
//!
//! ```text
//! cargo run -p freshlock-axum-example -- [--database-url URL] [--listen ADDR] [--nodes N]
//!                                        [--timeout-ms MS] [--check]
//! ```
//!
//! `--check` starts the service on a loopback port, runs the load script against it (four
//! concurrent writers per row, then a read-back), prints the result and exits non-zero if any
//! acknowledged write was lost.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use clap::Parser;
use entity::node;
use freshlock::LockPolicy;
use freshlock::lock::LocalLock;
use freshlock_axum_example::{AppState, app, check};
use migration::{Migrator, MigratorTrait};
use sea_orm::{ConnectOptions, Database, EntityTrait};

/// The example service on freshlock (a SQLite scratch file unless `--database-url` is given).
#[derive(Parser)]
#[command(name = "axum_service")]
struct Args {
    /// The database to serve (default: a SQLite scratch file in the temp directory, removed
    /// after `--check`).
    #[arg(long)]
    database_url: Option<String>,
    /// Where to listen (`--check` listens on a free loopback port instead).
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Rows seeded (ids 1..=N; existing rows are kept).
    #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(i32).range(1..))]
    nodes: i32,
    /// The request timeout in milliseconds (answered 408).
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// Run the load script against the service and exit (non-zero if a write was lost).
    #[arg(long)]
    check: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_target(false).init();
    let mut args = Args::parse();
    let scratch = std::env::temp_dir().join(format!("freshlock-axum-{}.db", std::process::id()));
    let (database_url, scratch) = match args.database_url.take() {
        Some(url) => (url, None),
        None => (
            format!("sqlite://{}?mode=rwc", scratch.display()),
            Some(scratch),
        ),
    };
    if args.check {
        args.listen.set_port(0);
    }
    let timeout = Duration::from_millis(args.timeout_ms);
    let mut options = ConnectOptions::new(database_url.clone());
    options.sqlx_logging(false);
    let db = Database::connect(options).await?;
    Migrator::up(&db, None).await?;
    for id in 1..=args.nodes {
        let row = node::ActiveModel::fresh(id);
        // Seeding is idempotent: existing rows are kept.
        let _ = node::Entity::insert(row)
            .on_conflict_do_nothing()
            .exec_without_returning(&db)
            .await?;
    }
    let state = AppState {
        db: freshlock::Db::new(db),
        lock: Arc::new(LocalLock::new()),
        policy: LockPolicy::default(),
    };
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, database = %database_url, "listening");
    let server = tokio::spawn(async move { axum::serve(listener, app(state, timeout)).await });
    if !args.check {
        server.await??;
        return Ok(());
    }
    let mut failed = false;
    for round in 1..=3 {
        let report = check(addr, "", args.nodes, round, 20).await?;
        println!(
            "round {round}: {} requests, {} acknowledged, {} timed out, {} lost, {} unexpected",
            report.sent,
            report.ok,
            report.timed_out,
            report.lost.len(),
            report.unexpected.len()
        );
        for line in report.lost.iter().chain(&report.corrupt) {
            println!("  {line}");
        }
        failed |= !report.passed();
    }
    server.abort();
    if let Some(scratch) = &scratch {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", scratch.display()));
        }
    }
    if failed {
        return Err("the check failed: acknowledged writes were lost".into());
    }
    println!("check passed: no acknowledged write lost");
    Ok(())
}
