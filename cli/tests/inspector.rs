//! The inspector command against a SQLite file: a live lease is listed with its holder and never
//! cleared; an expired one is listed with `--expired` and cleared by `release --stale`.

use std::{process::Command, time::Duration};

use freshlock::{LockBackend, LockName, lock::TableLock};
use migration::{Migrator, MigratorTrait};
use sea_orm::{ConnectOptions, Database};

fn freshlock(url: &str, args: &[&str]) -> serde_json::Value {
    let output = Command::new(env!("CARGO_BIN_EXE_freshlock"))
        .args(["--database-url", url, "--json"])
        .args(args)
        .output()
        .expect("run freshlock");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("one JSON object on stdout")
}

fn names(listing: &serde_json::Value) -> Vec<String> {
    listing["locks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_holders_and_clears_only_expired_leases() {
    let path = std::env::temp_dir().join(format!("fl_cli_{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let mut options = ConnectOptions::new(url.clone());
    options.max_connections(2).sqlx_logging(false);
    let db = Database::connect(options).await.unwrap();
    Migrator::up(&db, None).await.unwrap();

    let live = TableLock::new(db.clone()).with_label("importer");
    let held = live
        .acquire(
            &LockName::new("ham:1").unwrap(),
            Duration::ZERO,
            Duration::from_secs(3600),
        )
        .await
        .unwrap()
        .unwrap();
    let dying = TableLock::new(db.clone()).with_label("crashed");
    let stale = dying
        .acquire(
            &LockName::new("ham:2").unwrap(),
            Duration::ZERO,
            Duration::from_millis(1),
        )
        .await
        .unwrap()
        .unwrap();
    std::mem::forget(stale);
    while freshlock::inspect::held_locks(&db, true)
        .await
        .unwrap()
        .is_empty()
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let all = freshlock(&url, &["locks"]);
    assert_eq!(names(&all), ["ham:1", "ham:2"]);
    let live_row = &all["locks"][0];
    assert_eq!(live_row["label"], "importer");
    assert_eq!(live_row["pid"], i64::from(std::process::id()));
    assert_eq!(live_row["expired"], false);

    assert_eq!(names(&freshlock(&url, &["locks", "--expired"])), ["ham:2"]);
    assert_eq!(freshlock(&url, &["release", "--stale"])["released"], 1);
    assert_eq!(
        names(&freshlock(&url, &["locks"])),
        ["ham:1"],
        "the live lease stays"
    );
    assert_eq!(freshlock(&url, &["release", "--stale"])["released"], 0);
    held.release().await.unwrap();
    let _ = std::fs::remove_file(&path);
}
