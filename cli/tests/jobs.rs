//! `freshlock jobs` on SQLite, PostgreSQL and MariaDB: the depth per kind and key, the failed
//! jobs with their errors, a retry, a discard and a prune.

mod common;

use std::process::Command;

use freshlock::{
    Session,
    jobs::{self, Enqueued, Job, Jobs, NewJob, RetryPolicy, Worker},
};
use migration::{Migrator, MigratorTrait};

fn freshlock(url: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_freshlock"))
        .args(["--database-url", url, "--json"])
        .args(args)
        .output()
        .expect("run freshlock")
}

fn json(url: &str, args: &[&str]) -> serde_json::Value {
    let output = freshlock(url, args);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON on stdout")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_on_sqlite() {
    let path = std::env::temp_dir().join(format!("{}.db", common::unique("cli-jobs")));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    inspect_retry_discard(&url).await;
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_on_postgres() {
    if let Some(fresh) = common::fresh_database("postgres", "cli_jobs").await {
        inspect_retry_discard(&fresh.url).await;
        fresh.drop_database().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_on_mariadb() {
    if let Some(fresh) = common::fresh_database("mysql", "cli_jobs").await {
        inspect_retry_discard(&fresh.url).await;
        fresh.drop_database().await;
    }
}

async fn inspect_retry_discard(url: &str) {
    let db = common::connect(url).await;
    Migrator::up(&db, None).await.unwrap();
    for key in ["ham:1", "ham:1", "ham:2"] {
        let job = NewJob::new("spam", &0).unwrap().key(key);
        jobs::enqueue(&db, job).await.unwrap();
    }
    let Enqueued::Added(failing) = jobs::enqueue(&db, NewJob::new("broken", &"x").unwrap())
        .await
        .unwrap()
    else {
        panic!("added");
    };
    // The handler of "broken" takes a number: its string payload fails the job at once. (The
    // spam jobs are discarded below, before the worker runs: it knows no "spam" kind.)
    let handlers = Jobs::new().handle(
        "broken",
        RetryPolicy::default(),
        jobs::handler(|_tx, _job: Job<i32>| Box::pin(async move { Ok(()) })),
    );
    let depth = json(url, &["jobs"]);
    let rows = depth.as_array().unwrap();
    let of = |kind: &str, key: &str| {
        rows.iter()
            .find(|r| r["kind"] == kind && r["key"] == key)
            .map(|r| r["waiting"].as_u64().unwrap())
    };
    assert_eq!(of("spam", "ham:1"), Some(2), "{depth}");
    assert_eq!(of("spam", "ham:2"), Some(1), "{depth}");
    let ham1 = json(
        url,
        &[
            "jobs", "list", "--state", "waiting", "--kind", "spam", "--key", "ham:1",
        ],
    );
    let ham1 = ham1.as_array().unwrap();
    assert_eq!(ham1.len(), 2, "{ham1:?}");
    assert!(
        ham1.iter()
            .all(|job| job["key"] == "ham:1" && job["finished_at_ms"].is_null())
    );
    assert!(ham1[0]["created_at_ms"].as_i64().unwrap() > 0);
    let waiting = json(url, &["jobs", "list", "--state", "waiting"]);
    for job in waiting.as_array().unwrap() {
        if job["kind"] == "spam" {
            let id = job["id"].as_i64().unwrap().to_string();
            json_or_text(url, &["jobs", "discard", &id]);
        }
    }
    let worker = Worker::new(Session::new(db.clone()), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    assert_eq!(runs.len(), 1);
    let failed = json(url, &["jobs", "list", "--state", "failed"]);
    let failed = failed.as_array().unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["id"], failing);
    assert!(
        failed[0]["last_error"]
            .as_str()
            .unwrap()
            .contains("does not deserialize"),
        "{failed:?}"
    );
    let id = failing.to_string();
    json_or_text(url, &["jobs", "retry", &id]);
    let again = freshlock(url, &["jobs", "retry", &id]);
    assert!(
        !again.status.success(),
        "a job that is not failed cannot be retried"
    );
    assert!(String::from_utf8_lossy(&again.stderr).contains("no failed job has id"));
    let discarded = json(url, &["jobs", "list", "--state", "discarded"]);
    assert_eq!(discarded.as_array().unwrap().len(), 3);
    let waiting = json(url, &["jobs", "list", "--state", "waiting"]);
    assert_eq!(
        waiting.as_array().unwrap().len(),
        1,
        "the retried job waits"
    );
    let bad = freshlock(url, &["jobs", "list", "--state", "stuck"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr)
            .contains("expected waiting, leased, done, failed, discarded or cancelled")
    );
    // Pruning: the three discarded jobs go, the waiting one stays.
    let pruned = json(url, &["jobs", "prune", "--older-than", "0s"]);
    assert_eq!(pruned["pruned"], 3, "{pruned}");
    let discarded = json(url, &["jobs", "list", "--state", "discarded"]);
    assert!(discarded.as_array().unwrap().is_empty());
    let waiting = json(url, &["jobs", "list", "--state", "waiting"]);
    assert_eq!(waiting.as_array().unwrap().len(), 1);
    // The retried job is cancelled before it runs, once.
    let cancelled = freshlock(url, &["jobs", "cancel", &id]);
    assert!(cancelled.status.success());
    assert!(String::from_utf8_lossy(&cancelled.stdout).contains("cancelled"));
    let cancelled = json(url, &["jobs", "list", "--state", "cancelled"]);
    assert_eq!(cancelled.as_array().unwrap().len(), 1);
    let again = freshlock(url, &["jobs", "cancel", &id]);
    assert!(
        !again.status.success(),
        "a cancelled job is not cancelled again"
    );
    assert!(String::from_utf8_lossy(&again.stderr).contains("no unfinished job has id"));
    json_or_text(url, &["jobs", "prune", "--older-than", "7d", "--failed"]);
    let bad = freshlock(url, &["jobs", "prune", "--older-than", "7x"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("expected a whole number and s, m, h or d")
    );
}

/// Runs a command that prints a line of text and must succeed.
fn json_or_text(url: &str, args: &[&str]) {
    let output = freshlock(url, args);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
