//! The inspector command on SQLite, PostgreSQL and MariaDB: a live lease is listed with its
//! holder and never cleared; an expired one is listed with `--expired` and cleared by `release
//! --stale`; `release --compact` then deletes the rows nobody holds and the name's next fence is
//! above every earlier one.

mod common;

use std::{process::Command, time::Duration};

use freshlock::lock::backend::LeaseLock;
use freshlock::lock::{LockName, TableLock};
use migration::{Migrator, MigratorTrait};

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
    let path = std::env::temp_dir().join(format!("{}.db", common::unique("cli")));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    lists_and_clears(&url).await;
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_holders_and_clears_only_expired_leases_on_postgres() {
    if let Some(fresh) = common::fresh_database("postgres", "cli").await {
        lists_and_clears(&fresh.url).await;
        fresh.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_holders_and_clears_only_expired_leases_on_mariadb() {
    if let Some(fresh) = common::fresh_database("mysql", "cli").await {
        lists_and_clears(&fresh.url).await;
        fresh.drop_database().await;
    }
}

/// A live lease and a dead holder's expired one: `locks` lists both with their holders, `locks
/// --expired` and `release --stale` only the expired one.
async fn lists_and_clears(url: &str) {
    let url = url.to_owned();
    let db = common::connect(&url).await;
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
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while freshlock::inspect::held_locks(&db, freshlock::inspect::Held::Expired)
        .await
        .unwrap()
        .is_empty()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the 1 ms lease never expired"
        );
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

    // ham:2 was released by `--stale`; ham:3 is granted and released again and again. Rows
    // granted less than an hour ago stay; with `--idle-secs 0` the free ones go, the held one
    // (ham:1) stays, and the fence floor covers what was deleted.
    let ham3 = LockName::new("ham:3").unwrap();
    let mut last = 0;
    for _ in 0..4 {
        let guard = live
            .acquire(&ham3, Duration::ZERO, Duration::from_secs(60))
            .await
            .unwrap()
            .unwrap();
        last = guard.fence().unwrap();
        guard.release().await.unwrap();
    }
    let kept = freshlock(&url, &["release", "--compact", "--idle-secs", "3600"]);
    assert_eq!(kept["deleted_lock_rows"], 0);
    let both = freshlock(
        &url,
        &["release", "--stale", "--compact", "--idle-secs", "0"],
    );
    assert_eq!(both["released"], 0);
    assert_eq!(both["deleted_lock_rows"], 2, "ham:2 and ham:3: {both}");
    assert!(both["fence_floor"].as_i64().unwrap() >= last as i64);
    assert_eq!(names(&freshlock(&url, &["locks"])), ["ham:1"]);
    let again = live
        .acquire(&ham3, Duration::ZERO, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    assert!(
        again.fence().unwrap() > last,
        "fences of ham:3 keep growing"
    );
    again.release().await.unwrap();
    held.release().await.unwrap();
    db.close().await.unwrap();
}
