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

use entity::node;
use freshlock::{LocalLock, LockPolicy};
use freshlock_axum_example::{AppState, app, check};
use migration::{Migrator, MigratorTrait};
use sea_orm::{ConnectOptions, Database, EntityTrait};

struct Args {
    database_url: String,
    /// The SQLite file made when no URL was given: removed after `--check`.
    scratch: Option<std::path::PathBuf>,
    listen: SocketAddr,
    nodes: i32,
    timeout: Duration,
    check: bool,
}

fn args() -> Result<Args, String> {
    let scratch = std::env::temp_dir().join(format!("freshlock-axum-{}.db", std::process::id()));
    let mut args = Args {
        database_url: format!("sqlite://{}?mode=rwc", scratch.display()),
        scratch: Some(scratch),
        listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
        nodes: 25,
        timeout: Duration::from_secs(2),
        check: false,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let mut value = || given.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--database-url" => {
                args.database_url = value()?;
                args.scratch = None;
            }
            "--listen" => args.listen = value()?.parse().map_err(|e| format!("--listen: {e}"))?,
            "--nodes" => args.nodes = value()?.parse().map_err(|e| format!("--nodes: {e}"))?,
            "--timeout-ms" => {
                let ms = value()?.parse().map_err(|e| format!("--timeout-ms: {e}"))?;
                args.timeout = Duration::from_millis(ms);
            }
            "--check" => args.check = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.check {
        args.listen.set_port(0);
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_target(false).init();
    let args = args()?;
    let mut options = ConnectOptions::new(args.database_url.clone());
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
        db,
        lock: Arc::new(LocalLock::new()),
        policy: LockPolicy::default(),
    };
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, database = %args.database_url, "listening");
    let server = tokio::spawn(async move { axum::serve(listener, app(state, args.timeout)).await });
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
    if let Some(scratch) = &args.scratch {
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
