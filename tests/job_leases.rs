//! Leased jobs (`Jobs::handle_leased`) on SQLite, PostgreSQL and MariaDB: the field report's
//! claim → work outside any transaction → fenced finish. Every finished job's effect is in the
//! database once; a late finish after a takeover is refused; the heartbeat keeps a long job's
//! lease; an expired lease makes the job run again, and a job whose every attempt's lease
//! expired fails. On PostgreSQL and MariaDB each runs again on a session with two flights,
//! where the claim and the finish go on a held connection (`jobs/flights/`).

#[macro_use]
#[path = "common/job_support.rs"]
mod job_support;
#[path = "common/servers.rs"]
mod servers;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use freshlock::{
    Session, Tx,
    jobs::{self, Job, JobFailure, JobOutcome, JobState, Jobs, Lease, NewJob, RetryPolicy, Worker},
};
use job_support::{
    add, at_once, bigint, bump, bump_output, jobs_in, number, run_in_background, total_score,
};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use serde::{Deserialize, Serialize};
use servers::{TestDb, databases};
use tokio::sync::{mpsc, watch};

const LEASED: i16 = 1;
const DONE: i16 = 2;
const FAILED: i16 = 3;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Analyze {
    node: i32,
    seq: u32,
}

/// A session on `handle`; `two_flights`: its jobs' attempts, finishes included, in few round
/// trips (`SessionBuilder::two_flights`).
fn session(handle: &freshlock::Db, two_flights: bool) -> Session {
    Session::builder(handle.clone())
        .two_flights(two_flights)
        .build()
        .expect("session")
}

/// The state of job `id` as stored.
async fn state_of(db: &DatabaseConnection, id: i64) -> i64 {
    let state = bigint(db, "state");
    number(
        db,
        &format!("SELECT {state} FROM freshlock_job WHERE id = {id}"),
    )
    .await
}

/// Expires every lease now, as if its worker had stopped long ago.
async fn expire_leases(db: &DatabaseConnection) {
    let txn = sea_orm::TransactionTrait::begin(db).await.unwrap();
    txn.execute_unprepared("UPDATE freshlock_job SET lease_until = 0 WHERE state = 1")
        .await
        .unwrap();
    txn.commit().await.unwrap();
}

// --------------------------------------------------------- claim, work outside, finish once

/// What the work saw.
#[derive(Default)]
struct Seen {
    /// Works run, per job.
    works: Mutex<HashMap<u32, usize>>,
    /// Works that found their job's claim committed (`leased`) while they ran.
    claimed: AtomicUsize,
    /// Same-key works running at once.
    running_hot: AtomicUsize,
    overlaps: AtomicUsize,
}

/// 24 leased jobs, a third on one key, run by two workers (one in batches of 4, whose works run
/// side by side): each job's work runs once with its claim committed (no transaction held), each
/// finish's write is in the database once, same-key works never overlap.
async fn leased_jobs_work_outside_and_finish_once(db: Option<TestDb>, two_flights: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(3).await;
    let (db, handle) = (db.db, db.handle);
    let seen = Arc::new(Seen::default());
    for seq in 0..24 {
        let node = (seq % 3) as i32 + 1;
        let mut job = NewJob::new("analyze", &Analyze { node, seq }).unwrap();
        if node == 1 {
            job = job.key("ham:1");
        }
        add(&db, job).await.unwrap();
    }
    let handlers = {
        let (seen, reader) = (seen.clone(), db.clone());
        Jobs::new().handle_leased(
            "analyze",
            at_once(1),
            Duration::from_secs(30),
            move |job: Job<Analyze>, lease: Lease| {
                let (seen, reader) = (seen.clone(), reader.clone());
                async move {
                    assert_eq!(lease.job(), job.id);
                    let hot = job.key.is_some();
                    if hot && seen.running_hot.fetch_add(1, Ordering::SeqCst) > 0 {
                        seen.overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    // The claim committed before the work: another connection sees it.
                    if state_of(&reader, job.id).await == i64::from(LEASED) {
                        seen.claimed.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::task::yield_now().await;
                    if hot {
                        seen.running_hot.fetch_sub(1, Ordering::SeqCst);
                    }
                    *seen
                        .works
                        .lock()
                        .unwrap()
                        .entry(job.payload.seq)
                        .or_default() += 1;
                    Ok::<_, freshlock::ApplyError>(job.payload.node)
                }
            },
            bump_output,
        )
    };
    let session = session(&handle, two_flights);
    let single = Worker::new(session.clone(), handlers.clone());
    let batched = Worker::new(session, handlers).with_batch(4);
    let (a, b) = tokio::join!(single.run_until_idle(), batched.run_until_idle());
    let runs: Vec<_> = a.unwrap().into_iter().chain(b.unwrap()).collect();
    assert_eq!(runs.len(), 24, "{runs:?}");
    assert!(runs.iter().all(|r| r.outcome == JobOutcome::Completed));
    assert!(runs.iter().all(|r| r.attempt == 1));
    let works = seen.works.lock().unwrap().clone();
    assert_eq!(works.len(), 24);
    assert!(works.values().all(|&n| n == 1), "{works:?}");
    assert_eq!(seen.claimed.load(Ordering::SeqCst), 24);
    assert_eq!(seen.overlaps.load(Ordering::SeqCst), 0);
    assert_eq!(total_score(&db).await, 24, "every finish's write once");
    assert_eq!(jobs_in(&db, DONE).await, 24);
    let sum = bigint(&db, "SUM(attempts)");
    let attempts = number(&db, &format!("SELECT {sum} FROM freshlock_job")).await;
    assert_eq!(attempts, 24);
}

servers::server_tests! {
    leased_jobs_finish_once_sqlite: leased_jobs_work_outside_and_finish_once, false, sqlite;
    leased_jobs_finish_once_postgres: leased_jobs_work_outside_and_finish_once, false, postgres;
    leased_jobs_finish_once_mysql: leased_jobs_work_outside_and_finish_once, false, mysql;
    finish_once_postgres_flights: leased_jobs_work_outside_and_finish_once, true, postgres;
    finish_once_mysql_flights: leased_jobs_work_outside_and_finish_once, true, mysql;
}

// ------------------------------------------------------------------- a late finish refused

/// Gates for a work: it says when it started, and waits for `release` on its first attempt.
struct Gate {
    started: mpsc::Sender<u32>,
    release: watch::Receiver<bool>,
}

/// [`gated_jobs`] with a gate of its own: the handlers, the attempts started (in order) and
/// the release of first attempts.
fn gated(lease: Duration) -> (Jobs, mpsc::Receiver<u32>, watch::Sender<bool>) {
    let (started_tx, started) = mpsc::channel(4);
    let (release_tx, release) = watch::channel(false);
    let gate = Gate {
        started: started_tx,
        release,
    };
    (gated_jobs(gate, lease, at_once(3)), started, release_tx)
}

/// Adds `job`: its id.
async fn added(db: &DatabaseConnection, job: NewJob) -> i64 {
    match add(db, job).await.unwrap() {
        jobs::Enqueued::Added(id) => id,
        other => panic!("{other:?}"),
    }
}

fn gated_jobs(gate: Gate, lease: Duration, policy: RetryPolicy) -> Jobs {
    let gate = Arc::new(gate);
    Jobs::new().handle_leased(
        "analyze",
        policy,
        lease,
        move |job: Job<Analyze>, lease: Lease| {
            let gate = gate.clone();
            async move {
                gate.started.send(job.attempt).await.unwrap();
                if job.attempt == 1 {
                    let mut release = gate.release.clone();
                    release.wait_for(|go| *go).await.unwrap();
                }
                Ok::<_, freshlock::ApplyError>((job.payload.node, lease.is_lost()))
            }
        },
        async |tx: &Tx, _job: Job<Analyze>, done: &(i32, bool)| {
            bump(tx, done.0).await?;
            Ok(())
        },
    )
}

/// Worker A claims the job and works; its lease expires; worker B reclaims the job and runs it
/// to the end; A's late finish is refused and rolls back: one effect, the job done once.
async fn a_late_finish_after_a_takeover_is_refused(db: Option<TestDb>, two_flights: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let job = NewJob::new("analyze", &Analyze { node: 1, seq: 0 }).unwrap();
    let id = added(&db, job).await;
    let (handlers, mut started, release_tx) = gated(Duration::from_secs(60));
    let a = Worker::new(session(&handle, two_flights), handlers.clone());
    let first = tokio::spawn(async move { a.run_one().await });
    assert_eq!(started.recv().await, Some(1));
    // While A works, the job is leased: its key busy, the operator sees it.
    assert_eq!(state_of(&db, id).await, i64::from(LEASED));
    let leased = jobs::list(&handle, JobState::Leased, 10).await.unwrap();
    assert_eq!(leased.len(), 1);
    assert_eq!((leased[0].id, leased[0].attempts), (id, 1));
    let depth = jobs::depth(&handle).await.unwrap();
    assert_eq!((depth[0].waiting, depth[0].due), (1, 0));
    // A fresh worker finds nothing while the lease holds ...
    let b = Worker::new(session(&handle, two_flights), handlers.clone());
    assert_eq!(b.run_one().await.unwrap(), None);
    // ... and takes the job over once it expired (a new worker: its reclaim is due at once).
    expire_leases(&db).await;
    let b = Worker::new(session(&handle, two_flights), handlers);
    let second = b.run_one().await.unwrap().expect("the job, reclaimed");
    assert_eq!(started.recv().await, Some(2));
    assert_eq!((second.id, second.attempt), (id, 2));
    assert_eq!(second.outcome, JobOutcome::Completed);
    release_tx.send(true).unwrap();
    let late = first.await.unwrap().unwrap().expect("A's run");
    assert_eq!((late.id, late.attempt), (id, 1));
    assert_eq!(late.outcome, JobOutcome::LeaseLost);
    assert_eq!(total_score(&db).await, 1, "B's finish only");
    assert_eq!(state_of(&db, id).await, i64::from(DONE));
    let attempts = format!(
        "SELECT {} FROM freshlock_job WHERE id = {id}",
        bigint(&db, "attempts")
    );
    assert_eq!(number(&db, &attempts).await, 2);
}

servers::server_tests! {
    a_late_finish_is_refused_sqlite: a_late_finish_after_a_takeover_is_refused, false, sqlite;
    a_late_finish_is_refused_postgres: a_late_finish_after_a_takeover_is_refused, false, postgres;
    a_late_finish_is_refused_mysql: a_late_finish_after_a_takeover_is_refused, false, mysql;
    late_finish_refused_postgres_flights: a_late_finish_after_a_takeover_is_refused, true, postgres;
    late_finish_refused_mysql_flights: a_late_finish_after_a_takeover_is_refused, true, mysql;
}

/// As above, with the key's next job queued behind the job and worker A in its run loop
/// (`run_until_idle`), where a finish claims the key's next job with its completion (on
/// MySQL/MariaDB with two flights, a promotion after the completion that checks it by the
/// completion's own count): A's late finish finds its claim gone, is refused and rolls back —
/// its write not committed, the next job not claimed by it — then A takes the next job and
/// runs it once.
async fn a_late_chained_finish_is_refused(db: Option<TestDb>, two_flights: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(2).await;
    let (db, handle) = (db.db, db.handle);
    let mut ids = Vec::new();
    for node in [1, 2] {
        let job = NewJob::new("analyze", &Analyze { node, seq: 0 }).unwrap();
        ids.push(added(&db, job.key("ham:1")).await);
    }
    let (handlers, mut started, release_tx) = gated(Duration::from_secs(60));
    let a = Worker::new(session(&handle, two_flights), handlers.clone());
    let first = tokio::spawn(async move { a.run_until_idle().await });
    assert_eq!(started.recv().await, Some(1));
    expire_leases(&db).await;
    let b = Worker::new(session(&handle, two_flights), handlers);
    let taken_over = b.run_one().await.unwrap().expect("the job, reclaimed");
    assert_eq!(started.recv().await, Some(2));
    assert_eq!(
        (taken_over.id, taken_over.attempt, taken_over.outcome),
        (ids[0], 2, JobOutcome::Completed)
    );
    release_tx.send(true).unwrap();
    let runs = first.await.unwrap().unwrap();
    let outcomes: Vec<_> = (runs.iter())
        .map(|run| (run.id, run.attempt, run.outcome.clone()))
        .collect();
    assert_eq!(
        outcomes,
        vec![
            (ids[0], 1, JobOutcome::LeaseLost),
            (ids[1], 1, JobOutcome::Completed)
        ]
    );
    assert_eq!(
        total_score(&db).await,
        2,
        "B's finish of the first job and A's of the second, once each"
    );
    for id in &ids {
        assert_eq!(state_of(&db, *id).await, i64::from(DONE));
    }
}

servers::server_tests! {
    a_late_chained_finish_is_refused_sqlite: a_late_chained_finish_is_refused, false, sqlite;
    a_late_chained_finish_is_refused_postgres: a_late_chained_finish_is_refused, false, postgres;
    a_late_chained_finish_is_refused_mysql: a_late_chained_finish_is_refused, false, mysql;
    late_chained_finish_refused_postgres_flights: a_late_chained_finish_is_refused, true, postgres;
    late_chained_finish_refused_mysql_flights: a_late_chained_finish_is_refused, true, mysql;
}

// ------------------------------------------------------------------------- the heartbeat

/// A work that runs longer than its lease keeps it: the heartbeat moves the expiry on, so a
/// worker that reclaims after the first expiry finds nothing, and the job finishes on its first
/// attempt. (Without the heartbeat the other worker takes the job over.)
async fn the_heartbeat_keeps_a_long_jobs_lease(db: Option<TestDb>, two_flights: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    add(
        &db,
        NewJob::new("analyze", &Analyze { node: 1, seq: 0 }).unwrap(),
    )
    .await
    .unwrap();
    let lease = Duration::from_millis(900);
    let (handlers, mut started, release_tx) = gated(lease);
    let a = Worker::new(session(&handle, two_flights), handlers.clone());
    let first = tokio::spawn(async move { a.run_one().await });
    assert_eq!(started.recv().await, Some(1));
    let expiry = "SELECT lease_until FROM freshlock_job WHERE state = 1";
    let claimed_until = number(&db, expiry).await;
    // Wait (on the database's clock) until the claim's first expiry has passed.
    let now = match db.get_database_backend() {
        sea_orm::DbBackend::Postgres => {
            "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)"
        }
        sea_orm::DbBackend::MySql => "SELECT CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
        _ => "SELECT CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    };
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while number(&db, now).await <= claimed_until + 200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    waited.await.expect("the database clock moves");
    assert!(
        number(&db, expiry).await > claimed_until,
        "the heartbeat extended the lease"
    );
    let b = Worker::new(session(&handle, two_flights), handlers);
    assert_eq!(b.run_one().await.unwrap(), None, "nothing to reclaim");
    release_tx.send(true).unwrap();
    let run = first.await.unwrap().unwrap().expect("A's run");
    assert_eq!((run.attempt, run.outcome), (1, JobOutcome::Completed));
    assert_eq!(total_score(&db).await, 1);
}

servers::server_tests! {
    the_heartbeat_keeps_the_lease_sqlite: the_heartbeat_keeps_a_long_jobs_lease, false, sqlite;
    the_heartbeat_keeps_the_lease_postgres: the_heartbeat_keeps_a_long_jobs_lease, false, postgres;
    the_heartbeat_keeps_the_lease_mysql: the_heartbeat_keeps_a_long_jobs_lease, false, mysql;
    heartbeat_postgres_flights: the_heartbeat_keeps_a_long_jobs_lease, true, postgres;
    heartbeat_mysql_flights: the_heartbeat_keeps_a_long_jobs_lease, true, mysql;
}

// ---------------------------------------------------------- stopped workers, used attempts

/// A worker stopped mid-work (its run dropped: no finish, no heartbeat) leaves the job leased
/// and its key busy until the lease expires; the job then runs again. When every attempt's
/// worker stopped, the job fails (`LeaseExpired`), its key is free, and the next job of the key
/// runs.
async fn stopped_workers_leases_expire_and_attempts_are_bounded(
    db: Option<TestDb>,
    two_flights: bool,
) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    for seq in 0..2 {
        let job = NewJob::new("analyze", &Analyze { node: 1, seq }).unwrap();
        add(&db, job.key("ham:1").unique(format!("spam:{seq}")))
            .await
            .unwrap();
    }
    let (started_tx, mut started) = mpsc::channel(8);
    let (_release_tx, release) = watch::channel(false);
    let stuck = Arc::new(Gate {
        started: started_tx,
        release,
    });
    // Every attempt of job 0 hangs; job 1 works.
    let handlers = Jobs::new().handle_leased(
        "analyze",
        at_once(2),
        Duration::from_secs(60),
        move |job: Job<Analyze>, _lease: Lease| {
            let stuck = stuck.clone();
            async move {
                if job.payload.seq == 0 {
                    stuck.started.send(job.attempt).await.unwrap();
                    let mut release = stuck.release.clone();
                    release.wait_for(|go| *go).await.unwrap();
                }
                Ok::<_, freshlock::ApplyError>(job.payload.node)
            }
        },
        bump_output,
    );
    for attempt in 1..=2 {
        let worker = Worker::new(session(&handle, two_flights), handlers.clone());
        let run = tokio::spawn(async move { worker.run_one().await });
        assert_eq!(started.recv().await, Some(attempt));
        run.abort();
        let _ = run.await;
        // The key stays busy while the lease holds: job 1 is not handed out.
        let other = Worker::new(session(&handle, two_flights), handlers.clone());
        assert_eq!(other.run_one().await.unwrap(), None);
        assert!(
            matches!(
                add(
                    &db,
                    NewJob::new("analyze", &Analyze { node: 1, seq: 0 })
                        .unwrap()
                        .unique("spam:0")
                )
                .await
                .unwrap(),
                jobs::Enqueued::Duplicate { .. }
            ),
            "a leased job keeps its unique key"
        );
        expire_leases(&db).await;
    }
    let worker = Worker::new(session(&handle, two_flights), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(
        runs[0].outcome,
        JobOutcome::Failed(JobFailure::LeaseExpired { attempts: 2 })
    );
    assert_eq!(runs[0].attempt, 2);
    assert_eq!(runs[1].outcome, JobOutcome::Completed);
    assert_eq!(jobs_in(&db, FAILED).await, 1);
    assert_eq!(jobs_in(&db, DONE).await, 1);
    assert_eq!(total_score(&db).await, 1, "the hung job's finish never ran");
    let failed = jobs::list(&handle, JobState::Failed, 10).await.unwrap();
    assert!(
        failed[0].last_error.as_deref().unwrap().contains("lease"),
        "{failed:?}"
    );
}

servers::server_tests! {
    stopped_workers_leases_expire_sqlite: stopped_workers_leases_expire_and_attempts_are_bounded, false, sqlite;
    stopped_workers_leases_expire_postgres: stopped_workers_leases_expire_and_attempts_are_bounded, false, postgres;
    stopped_workers_leases_expire_mysql: stopped_workers_leases_expire_and_attempts_are_bounded, false, mysql;
    leases_expire_postgres_flights: stopped_workers_leases_expire_and_attempts_are_bounded, true, postgres;
    leases_expire_mysql_flights: stopped_workers_leases_expire_and_attempts_are_bounded, true, mysql;
}

// ------------------------------------------------------------------ failures and bad input

/// A work that errors or panics and a finish that errors are failed attempts, retried per the
/// policy (the finish's write rolled back); a payload that does not deserialize fails at once;
/// a `retry_if` that refuses fails at once. The worker goes on; each completed job's write is
/// in the database once.
async fn leased_failures_retry_and_roll_back(db: Option<TestDb>, two_flights: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    // seq 1: the work errors once; 2: it panics once; 3: the finish errors once (after its
    // write); 4: the work errors with "fatal", which does not retry.
    for seq in 1..=4 {
        add(
            &db,
            NewJob::new("analyze", &Analyze { node: 1, seq }).unwrap(),
        )
        .await
        .unwrap();
    }
    add(&db, NewJob::new("analyze", &"not an Analyze").unwrap())
        .await
        .unwrap();
    let policy = at_once(3).retry_if(|e| !e.to_string().contains("fatal"));
    let handlers = Jobs::new().handle_leased(
        "analyze",
        policy,
        Duration::from_secs(60),
        |job: Job<Analyze>, _lease: Lease| async move {
            let Analyze { node, seq } = job.payload;
            match (seq, job.attempt) {
                (1, 1) => Err("the service is down".into()),
                (2, 1) => panic!("the work panicked"),
                (4, _) => Err("fatal: no such document".into()),
                _ => Ok((node, seq)),
            }
        },
        // The finish sees the job as enqueued beside what its work returned.
        async |tx: &Tx, job: Job<Analyze>, &(node, seq): &(i32, u32)| {
            assert_eq!((job.payload.node, job.payload.seq), (node, seq));
            bump(tx, node).await?;
            if seq == 3 && job.attempt == 1 {
                return Err(freshlock::ApplyError::msg("the finish failed"));
            }
            Ok(())
        },
    );
    let worker = Worker::new(session(&handle, two_flights), handlers).with_batch(4);
    let runs = worker.run_until_idle().await.unwrap();
    let outcomes: Vec<_> = runs.iter().map(|r| (r.id, r.attempt, &r.outcome)).collect();
    let completed = runs
        .iter()
        .filter(|r| r.outcome == JobOutcome::Completed)
        .count();
    assert_eq!(completed, 3, "{outcomes:?}");
    let retried = runs
        .iter()
        .filter(|r| matches!(r.outcome, JobOutcome::Retrying { .. }))
        .count();
    assert_eq!(retried, 3, "{outcomes:?}");
    assert!(runs.iter().any(|r| matches!(
        &r.outcome,
        JobOutcome::Retrying { failure: JobFailure::Panicked(m), .. } if m.contains("panicked")
    )));
    assert!(runs.iter().any(|r| matches!(
        &r.outcome,
        JobOutcome::Failed(JobFailure::Handler(m)) if m.contains("fatal")
    )));
    assert!(runs.iter().any(|r| matches!(
        &r.outcome,
        JobOutcome::Failed(JobFailure::BadPayload { .. })
    )));
    assert_eq!(total_score(&db).await, 3, "one write per completed job");
    assert_eq!(jobs_in(&db, DONE).await, 3);
    assert_eq!(jobs_in(&db, FAILED).await, 2);
    assert_eq!(jobs_in(&db, LEASED).await, 0, "every claim ended");
}

servers::server_tests! {
    leased_failures_sqlite: leased_failures_retry_and_roll_back, false, sqlite;
    leased_failures_postgres: leased_failures_retry_and_roll_back, false, postgres;
    leased_failures_mysql: leased_failures_retry_and_roll_back, false, mysql;
    leased_failures_postgres_flights: leased_failures_retry_and_roll_back, true, postgres;
    leased_failures_mysql_flights: leased_failures_retry_and_roll_back, true, mysql;
}

/// A worker that finished a leased job of a key follows the key: the key's next job, readied by
/// the finish, is the next it claims — before an older job of no key — so a hot key's chain
/// does not wait for a take that meets it first.
async fn a_finished_leased_job_is_followed_by_its_keys_next(db: Option<TestDb>, two_flights: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let analyze = |seq| NewJob::new("analyze", &Analyze { node: 1, seq }).unwrap();
    add(&db, analyze(1).key("hot")).await.unwrap();
    add(&db, analyze(2)).await.unwrap();
    add(&db, analyze(3).key("hot")).await.unwrap();
    let handlers = Jobs::new().handle_leased(
        "analyze",
        at_once(1),
        Duration::from_secs(30),
        async |job: Job<Analyze>, _lease: Lease| Ok(job.payload.node),
        bump_output,
    );
    let worker = Worker::new(session(&handle, two_flights), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    let ids: Vec<i64> = runs.iter().map(|run| run.id).collect();
    let first = ids[0];
    assert_eq!(
        ids,
        [first, first + 2, first + 1],
        "the key followed: {runs:#?}"
    );
    assert!(runs.iter().all(|run| run.outcome == JobOutcome::Completed));
    assert_eq!(total_score(&db).await, 3);
}

servers::server_tests! {
    leased_key_followed_sqlite: a_finished_leased_job_is_followed_by_its_keys_next, false, sqlite;
    leased_key_followed_postgres: a_finished_leased_job_is_followed_by_its_keys_next, false, postgres;
    leased_key_followed_mysql: a_finished_leased_job_is_followed_by_its_keys_next, false, mysql;
    leased_key_followed_postgres_flights: a_finished_leased_job_is_followed_by_its_keys_next, true, postgres;
    leased_key_followed_mysql_flights: a_finished_leased_job_is_followed_by_its_keys_next, true, mysql;
}

/// A worker's leased finish claims its key's next job in its own completion only as a take of
/// the worker would: a job of a kind it runs in the transaction is readied for a take, a job
/// not yet due is readied and left waiting, and every job runs once, in its key's order, its
/// effect in the database once.
async fn a_finish_claims_its_keys_next_job_only_as_a_take_would(
    db: Option<TestDb>,
    two_flights: bool,
) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let job = |kind: &str, seq| {
        NewJob::new(kind, &Analyze { node: 1, seq })
            .unwrap()
            .key("hot")
    };
    let added = async |job| match add(&db, job).await.unwrap() {
        jobs::Enqueued::Added(id) => id,
        other => panic!("{other:?}"),
    };
    let mut ids = Vec::new();
    for (kind, seq) in [("render", 1), ("note", 2), ("render", 3), ("render", 4)] {
        ids.push(added(job(kind, seq)).await);
    }
    let later = added(job("render", 5).delay(Duration::from_secs(3600))).await;
    let (ran, mut runs) = mpsc::unbounded_channel::<u32>();
    let noted = ran.clone();
    let handlers = Jobs::new()
        .handle_leased(
            "render",
            at_once(1),
            Duration::from_secs(30),
            move |job: Job<Analyze>, _lease: Lease| {
                let ran = ran.clone();
                async move {
                    let _ = ran.send(job.payload.seq);
                    Ok(job.payload.node)
                }
            },
            bump_output,
        )
        .handle(
            "note",
            at_once(1),
            jobs::handler(move |tx, job: Job<Analyze>| {
                let noted = noted.clone();
                Box::pin(async move {
                    bump(tx, job.payload.node).await?;
                    let _ = noted.send(job.payload.seq);
                    Ok(())
                })
            }),
        );
    let worker = Worker::new(session(&handle, two_flights), handlers);
    let (stop, running) = run_in_background(worker);
    let mut order = Vec::new();
    while order.len() < 4 {
        order.push(runs.recv().await.expect("a run"));
    }
    let _ = stop.send(());
    running.await.unwrap();
    assert_eq!(order, [1, 2, 3, 4], "the key's order, each job once");
    for id in ids {
        assert_eq!(state_of(&db, id).await, i64::from(DONE), "job {id}");
    }
    assert_eq!(state_of(&db, later).await, 0, "the job not yet due waits");
    let attempts = bigint(&db, "attempts");
    let sql = format!("SELECT {attempts} AS n FROM freshlock_job WHERE id = {later}");
    assert_eq!(number(&db, &sql).await, 0, "not claimed, not counted");
    assert_eq!(total_score(&db).await, 4, "each effect once");
}

servers::server_tests! {
    finish_claims_sqlite: a_finish_claims_its_keys_next_job_only_as_a_take_would, false, sqlite;
    finish_claims_postgres: a_finish_claims_its_keys_next_job_only_as_a_take_would, false, postgres;
    finish_claims_mysql: a_finish_claims_its_keys_next_job_only_as_a_take_would, false, mysql;
    finish_claims_postgres_flights: a_finish_claims_its_keys_next_job_only_as_a_take_would, true, postgres;
    finish_claims_mysql_flights: a_finish_claims_its_keys_next_job_only_as_a_take_would, true, mysql;
}
