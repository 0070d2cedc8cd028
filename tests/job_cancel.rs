//! Cancelling jobs (`jobs::cancel`) on SQLite, PostgreSQL and MariaDB: a waiting job is
//! cancelled at once and never runs, and its key's next job runs; a job running in a worker's
//! transaction is asked to stop, its writes roll back and it does not run again; a leased job's
//! work is told through its lease and its finish is refused. Every acknowledged job's effect is
//! in the rows, and no cancelled job's.

#[macro_use]
#[path = "common/job_support.rs"]
mod job_support;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use freshlock::{
    Session,
    jobs::{
        self, Cancel, Enqueued, Job, JobOutcome, JobRun, JobState, Jobs, Lease, NewJob, Worker,
    },
};
use job_support::{add, at_once, bump, bump_node, bump_output, number, total_score};
use sea_orm::DatabaseConnection;
use servers::{TestDb, databases};
use tokio::sync::{mpsc, watch};

/// Enqueues a job of `kind` bumping `node`, keyed `key`: its id.
async fn job(db: &DatabaseConnection, kind: &str, node: i32, key: &str) -> i64 {
    match add(db, NewJob::new(kind, &node).unwrap().key(key))
        .await
        .unwrap()
    {
        Enqueued::Added(id) => id,
        other => panic!("{other:?}"),
    }
}

/// How job `id` last ended among `runs`.
fn outcome(runs: &[JobRun], id: i64) -> Option<&JobOutcome> {
    (runs.iter())
        .filter(|run| run.id == id)
        .map(|run| &run.outcome)
        .next_back()
}

/// Requests to stop jobs that are still kept.
async fn requests(db: &DatabaseConnection) -> i64 {
    number(db, "SELECT COUNT(*) FROM freshlock_job_cancel").await
}

/// The ids of the jobs in `state` (through the application's handle: behind a transaction
/// pooler a plain pool's lone statement is the caller's own).
async fn in_state(db: &TestDb, state: JobState) -> Vec<i64> {
    let jobs = jobs::list(&db.handle, state, 100).await.unwrap();
    jobs.iter().map(|job| job.id).collect()
}

/// Two jobs of one key and a keyless one; the first is cancelled before any runs: it never
/// runs, the key's second job and the keyless one do.
async fn waiting_jobs_are_cancelled_at_once(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(3).await;
    let first = job(&db.db, "bump", 1, "k").await;
    let second = job(&db.db, "bump", 2, "k").await;
    let keyless = match add(&db.db, NewJob::new("bump", &3_i32).unwrap())
        .await
        .unwrap()
    {
        Enqueued::Added(id) => id,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        jobs::cancel(&db.handle, first).await.unwrap(),
        Cancel::Cancelled
    );
    assert_eq!(
        jobs::cancel(&db.handle, first).await.unwrap(),
        Cancel::Finished
    );
    assert_eq!(
        jobs::cancel(&db.handle, 999_999).await.unwrap(),
        Cancel::Finished
    );

    let handlers = Jobs::new().handle("bump", at_once(3), bump_node);
    let worker = Worker::new(Session::new(&db.handle), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    let mut completed: Vec<i64> = (runs.iter())
        .filter(|run| run.outcome == JobOutcome::Completed)
        .map(|run| run.id)
        .collect();
    completed.sort_unstable();
    assert_eq!(
        completed,
        vec![second, keyless],
        "the cancelled job never ran"
    );
    assert_eq!(
        total_score(&db.db).await,
        2,
        "every acknowledged job's effect, once"
    );
    assert_eq!(db.score(1).await, None);
    assert_eq!(in_state(&db, JobState::Cancelled).await, vec![first]);
    // A finished job is not cancelled.
    assert_eq!(
        jobs::cancel(&db.handle, second).await.unwrap(),
        Cancel::Finished
    );
    assert_eq!(in_state(&db, JobState::Done).await.len(), 2);
}

/// A job running in a worker's transaction when it is cancelled: asked to stop; its handler's
/// write rolls back, it runs no more (three attempts allowed), and its key's next job runs.
async fn running_job_is_rolled_back_and_not_run_again(db: Option<TestDb>) {
    running_job_is_cancelled(db, false).await;
}

/// The same when the handler then fails: cancelled, not retried.
async fn failing_running_job_is_not_retried(db: Option<TestDb>) {
    running_job_is_cancelled(db, true).await;
}

async fn running_job_is_cancelled(db: Option<TestDb>, fails: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(2).await;
    let first = job(&db.db, "slow", 1, "k").await;
    let second = job(&db.db, "slow", 2, "k").await;
    let (started, mut running) = mpsc::unbounded_channel();
    let (let_go, gate) = watch::channel(false);
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&ran);
    let slow = jobs::handler(move |tx, job: Job<i32>| {
        let (started, mut gate, counted) = (started.clone(), gate.clone(), Arc::clone(&counted));
        Box::pin(async move {
            if job.id == first {
                counted.fetch_add(1, Ordering::SeqCst);
            }
            bump(tx, job.payload).await?;
            let _ = started.send(job.id);
            let _ = gate.wait_for(|open| *open).await;
            if fails && job.id == first {
                return Err(freshlock::ApplyError::msg("the service said no"));
            }
            Ok(())
        })
    });
    let worker = Worker::new(
        Session::new(&db.handle),
        Jobs::new().handle("slow", at_once(3), slow),
    );
    let working = tokio::spawn(async move { worker.run_until_idle().await });

    assert_eq!(running.recv().await, Some(first));
    assert_eq!(
        jobs::cancel(&db.handle, first).await.unwrap(),
        Cancel::Requested
    );
    let_go.send(true).unwrap();
    let runs = working.await.unwrap().unwrap();

    assert_eq!(outcome(&runs, first), Some(&JobOutcome::Cancelled));
    assert_eq!(outcome(&runs, second), Some(&JobOutcome::Completed));
    // (The key's next job may have run in the same transaction, a chain, and again after it.)
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the cancelled job ran once");
    assert_eq!(
        db.score(1).await,
        None,
        "the cancelled job's write rolled back"
    );
    assert_eq!(db.score(2).await, Some(1));
    assert_eq!(in_state(&db, JobState::Cancelled).await, vec![first]);
    assert_eq!(
        requests(&db.db).await,
        0,
        "the request went with the cancel"
    );
}

/// A leased job cancelled while its work runs outside any transaction: the work's lease says
/// it is lost, the finish is refused (its write never lands), and the key's next job runs.
async fn leased_job_is_told_and_its_finish_refused(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(2).await;
    let first = job(&db.db, "render", 1, "k").await;
    let second = job(&db.db, "render", 2, "k").await;
    let (started, mut working) = mpsc::unbounded_channel();
    let handlers = Jobs::new().handle_leased(
        "render",
        at_once(3),
        Duration::from_millis(300),
        move |job: Job<i32>, lease: Lease| {
            let started = started.clone();
            async move {
                let _ = started.send(job.id);
                if job.id == first {
                    // Ends when the heartbeat finds the claim gone.
                    tokio::time::timeout(Duration::from_secs(30), lease.lost())
                        .await
                        .expect("the lease reports the cancel");
                }
                Ok(job.payload)
            }
        },
        bump_output,
    );
    let worker = Worker::new(Session::new(&db.handle), handlers);
    let running = tokio::spawn(async move { worker.run_until_idle().await });

    assert_eq!(working.recv().await, Some(first));
    assert_eq!(
        jobs::cancel(&db.handle, first).await.unwrap(),
        Cancel::Cancelled
    );
    let runs = running.await.unwrap().unwrap();

    assert_eq!(outcome(&runs, first), Some(&JobOutcome::Cancelled));
    assert_eq!(outcome(&runs, second), Some(&JobOutcome::Completed));
    assert_eq!(db.score(1).await, None, "the refused finish wrote nothing");
    assert_eq!(db.score(2).await, Some(1));
    assert_eq!(in_state(&db, JobState::Cancelled).await, vec![first]);
}

on_databases! {
    cancel_waiting_sqlite: waiting_jobs_are_cancelled_at_once, sqlite;
    cancel_waiting_postgres: waiting_jobs_are_cancelled_at_once, postgres;
    cancel_waiting_mysql: waiting_jobs_are_cancelled_at_once, mysql;
    // SQLite has one writer: a job running in its transaction holds it, and `cancel` waits.
    cancel_running_postgres: running_job_is_rolled_back_and_not_run_again, postgres;
    cancel_running_mysql: running_job_is_rolled_back_and_not_run_again, mysql;
    cancel_failing_postgres: failing_running_job_is_not_retried, postgres;
    cancel_failing_mysql: failing_running_job_is_not_retried, mysql;
    cancel_leased_sqlite: leased_job_is_told_and_its_finish_refused, sqlite;
    cancel_leased_postgres: leased_job_is_told_and_its_finish_refused, postgres;
    cancel_leased_mysql: leased_job_is_told_and_its_finish_refused, mysql;
}
