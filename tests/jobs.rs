//! Keyed jobs (`freshlock::jobs`) on SQLite, PostgreSQL and MariaDB: enqueue in the caller's
//! transaction, per-key order with no overlap under concurrent workers, every completed job's
//! effect in the database exactly once, retries, bad input, unique keys, hostile keys.

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
    ApplyError, ForUpdate, Session, Tx,
    jobs::{self, Enqueued, Job, JobFailure, JobOutcome, Jobs, NewJob, RetryPolicy, Worker},
};
use job_support::{add, at_once, bigint, bump, jobs_in, number, run_in_background, total_score};
use sea_orm::{
    ActiveValue::Set, ConnectionTrait, DatabaseConnection, IntoActiveModel, Statement,
    TransactionTrait,
};
use serde::{Deserialize, Serialize};
use servers::{TestDb, databases};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Bump {
    node: i32,
    seq: u32,
}

/// An in-memory SQLite database with the migrations run and node 1 (keep the first value alive
/// as long as the database is used).
async fn memory_with_node() -> (freshlock::testing::TestDatabase, DatabaseConnection) {
    let test = freshlock::testing::TestDatabase::with_migrator::<migration::Migrator>()
        .await
        .unwrap();
    let db = test.connection().clone();
    db.execute_unprepared("INSERT INTO node (id, title, changed) VALUES (1, 't', 0)")
        .await
        .unwrap();
    (test, db)
}

// ------------------------------------------------------------------ enqueue in a transaction

async fn enqueued_with_the_callers_transaction(db: Option<TestDb>) {
    let Some(db) = db else { return };
    let (db, handle) = (db.db, db.handle);
    db.execute_unprepared("INSERT INTO node (id, title, changed) VALUES (1, 't', 0)")
        .await
        .unwrap();
    let job = || NewJob::new("bump", &Bump { node: 1, seq: 0 }).unwrap();
    // Rolled back: the job never exists.
    let txn = db.begin().await.unwrap();
    assert!(matches!(
        jobs::enqueue(&txn, job()).await.unwrap(),
        Enqueued::Added(_)
    ));
    txn.rollback().await.unwrap();
    assert_eq!(number(&db, "SELECT COUNT(*) FROM freshlock_job").await, 0);
    // Committed: it exists, and runs once.
    let txn = db.begin().await.unwrap();
    let Enqueued::Added(id) = jobs::enqueue(&txn, job()).await.unwrap() else {
        panic!("added");
    };
    txn.commit().await.unwrap();
    let worker = Worker::new(Session::new(&handle), bump_jobs(RetryPolicy::default()));
    let runs = worker.run_until_idle().await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!((runs[0].id, runs[0].attempt), (id, 1));
    assert_eq!(runs[0].outcome, JobOutcome::Completed);
    assert_eq!(total_score(&db).await, 1);
    assert_eq!(jobs_in(&db, 2).await, 1);
    assert!(worker.run_one().await.unwrap().is_none());
}

fn bump_jobs(policy: RetryPolicy) -> Jobs {
    Jobs::new().handle(
        "bump",
        policy,
        jobs::handler(|tx, job: Job<Bump>| {
            Box::pin(async move {
                bump(tx, job.payload.node).await?;
                Ok(())
            })
        }),
    )
}

on_databases! {
    enqueue_follows_the_transaction_sqlite: enqueued_with_the_callers_transaction, sqlite;
    enqueue_follows_the_transaction_postgres: enqueued_with_the_callers_transaction, postgres;
    enqueue_follows_the_transaction_mysql: enqueued_with_the_callers_transaction, mysql;
}

#[tokio::test]
async fn a_section_enqueues_in_its_own_transaction_and_handlers_run_inline_on_memory_sqlite() {
    let (_test, db) = memory_with_node().await;
    let session = Session::new(db.clone());
    let lock = freshlock::lock::LockName::new("ham:1").unwrap();
    // A section that fails after enqueuing: the job goes with its transaction.
    let failed: freshlock::Result<freshlock::SectionReport<()>> = session
        .with_lock(&lock, |tx| {
            Box::pin(async move {
                jobs::enqueue(tx, NewJob::new("bump", &Bump { node: 1, seq: 1 })?).await?;
                Err(freshlock::ApplyError::msg("changed my mind"))
            })
        })
        .await;
    assert!(failed.is_err());
    session
        .with_lock(&lock, |tx| {
            Box::pin(async move {
                jobs::enqueue(tx, NewJob::new("bump", &Bump { node: 1, seq: 2 })?).await?;
                Ok(())
            })
        })
        .await
        .unwrap();
    let worker = Worker::new(session, bump_jobs(RetryPolicy::default()));
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 1);
    assert_eq!(total_score(&db).await, 1);
}

// ------------------------------------------------------------- concurrent workers, hot keys

/// What the handlers saw: per key, how many run right now and the order they ran in.
#[derive(Default)]
struct Seen {
    running: Mutex<HashMap<String, usize>>,
    order: Mutex<HashMap<String, Vec<u32>>>,
    overlaps: AtomicUsize,
}

async fn keyed_jobs_run_once_in_order_without_overlap(db: Option<TestDb>) {
    let Some(db) = db else { return };
    const NODES: i32 = 4;
    const PER_NODE: u32 = 25;
    const KEYLESS: u32 = 20;
    db.seed_nodes(NODES + 1).await;
    let (db, handle) = (db.db, db.handle);
    // Node 1 is hot: half the jobs. The keyless jobs bump node NODES + 1.
    let mut enqueued = 0;
    for seq in 0..PER_NODE {
        for node in 1..=NODES {
            let copies = if node == 1 { NODES - 1 } else { 1 };
            for _ in 0..copies {
                let job = NewJob::new("bump", &Bump { node, seq }).unwrap();
                add(&db, job.key(format!("node:{node}"))).await.unwrap();
                enqueued += 1;
            }
        }
    }
    for seq in 0..KEYLESS {
        let job = NewJob::new(
            "bump",
            &Bump {
                node: NODES + 1,
                seq,
            },
        )
        .unwrap();
        add(&db, job).await.unwrap();
        enqueued += 1;
    }
    let seen = Arc::new(Seen::default());
    let completed = Arc::new(AtomicUsize::new(0));
    let handlers = {
        let seen = Arc::clone(&seen);
        Jobs::new().handle(
            "bump",
            at_once(5),
            jobs::handler(move |tx, job: Job<Bump>| {
                let seen = Arc::clone(&seen);
                Box::pin(async move {
                    let key = job.key.clone().unwrap_or_default();
                    if !key.is_empty() {
                        let mut running = seen.running.lock().unwrap();
                        let now = running.entry(key.clone()).or_default();
                        if *now > 0 {
                            seen.overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        *now += 1;
                        let mut order = seen.order.lock().unwrap();
                        order.entry(key.clone()).or_default().push(job.payload.seq);
                    }
                    // Let the other workers run while this job holds its key.
                    for _ in 0..3 {
                        tokio::task::yield_now().await;
                    }
                    let bumped = bump(tx, job.payload.node).await;
                    if !key.is_empty() {
                        *seen.running.lock().unwrap().get_mut(&key).unwrap() -= 1;
                    }
                    bumped?;
                    Ok(())
                })
            }),
        )
    };
    let session = Session::new(&handle);
    let mut workers = Vec::new();
    // Two workers take one job at a time, two take batches of up to 8 (never two jobs of one
    // key in a batch).
    for batch in [1, 8, 1, 8] {
        let worker = Worker::new(session.clone(), handlers.clone()).with_batch(batch);
        let completed = Arc::clone(&completed);
        workers.push(tokio::spawn(async move {
            loop {
                let runs = worker.run_batch().await.unwrap();
                for run in &runs {
                    assert_eq!(run.outcome, JobOutcome::Completed, "{run:?}");
                    completed.fetch_add(1, Ordering::SeqCst);
                }
                if runs.is_empty() {
                    if completed.load(Ordering::SeqCst) == enqueued {
                        return;
                    }
                    // Every due job's key is busy with another worker: look again.
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    assert_eq!(completed.load(Ordering::SeqCst), enqueued);
    assert_eq!(
        seen.overlaps.load(Ordering::SeqCst),
        0,
        "same-key jobs overlapped"
    );
    let order = seen.order.lock().unwrap().clone();
    for node in 1..=NODES {
        let ran = &order[&format!("node:{node}")];
        let mut sorted = ran.clone();
        sorted.sort_unstable();
        assert_eq!(ran, &sorted, "node:{node} ran out of enqueue order");
    }
    // Every completed job's effect is in the database exactly once.
    assert_eq!(total_score(&db).await, enqueued as i64);
    assert_eq!(jobs_in(&db, 2).await, enqueued as i64);
}

on_databases! {
    keyed_jobs_once_in_order_sqlite: keyed_jobs_run_once_in_order_without_overlap, sqlite;
    keyed_jobs_once_in_order_postgres: keyed_jobs_run_once_in_order_without_overlap, postgres;
    keyed_jobs_once_in_order_mysql: keyed_jobs_run_once_in_order_without_overlap, mysql;
}

/// Eight workers that run until idle, over a hot key's jobs and other keys': none stops while a
/// job is ready, so every job runs, once. Each worker sweeps for stranded jobs when a take first
/// comes back empty, while the others run theirs. On MariaDB a sweep that was one `UPDATE` locked
/// every row it read and held them while it waited for a running job's row: every take skipped
/// them, found nothing, and the workers stopped with the hot key's jobs left: this test failed 4
/// runs out of 4, by its ninth round at the latest (CI's demo: 72 of 100 tasks ran).
async fn workers_run_until_idle_leave_nothing(db: Option<TestDb>) {
    let Some(db) = db else { return };
    const ROUNDS: i64 = 10;
    const JOBS: i64 = 200;
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let handlers = Jobs::new().handle(
        "bump",
        at_once(5),
        jobs::handler(|tx, job: Job<Bump>| {
            Box::pin(async move {
                tokio::task::yield_now().await;
                bump(tx, job.payload.node).await?;
                Ok(())
            })
        }),
    );
    for round in 1..=ROUNDS {
        let txn = db.begin().await.unwrap();
        for seq in 0..JOBS {
            let key = match seq % 2 {
                0 => "hot".to_owned(),
                _ => format!("cold:{}", seq % 23),
            };
            let job = NewJob::new("bump", &Bump { node: 1, seq: 0 }).unwrap();
            jobs::enqueue(&txn, job.key(key)).await.unwrap();
        }
        txn.commit().await.unwrap();
        let mut workers = Vec::new();
        for _ in 0..8 {
            let worker = Worker::new(Session::new(&handle), handlers.clone());
            workers.push(tokio::spawn(async move { worker.run_until_idle().await }));
        }
        let mut ran = 0;
        for worker in workers {
            let runs = worker.await.unwrap().unwrap();
            assert!(runs.iter().all(|r| r.outcome == JobOutcome::Completed));
            ran += runs.len() as i64;
        }
        let left = number(&db, "SELECT COUNT(*) FROM freshlock_job WHERE state <> 2").await;
        assert_eq!((ran, left), (JOBS, 0), "round {round}: jobs left behind");
        // Every completed job's effect is in the database exactly once.
        assert_eq!(total_score(&db).await, round * JOBS);
    }
}

// Four threads: the workers' statements overlap more than on two.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_until_idle_leaves_nothing_sqlite() {
    workers_run_until_idle_leave_nothing(databases::sqlite("run_until_idle_sqlite").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_until_idle_leaves_nothing_postgres() {
    workers_run_until_idle_leave_nothing(databases::postgres("run_until_idle_pg").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_until_idle_leaves_nothing_mysql() {
    workers_run_until_idle_leave_nothing(databases::mysql("run_until_idle_mysql").await).await;
}

/// A worker is never handed a job whose key is busy: it takes another key's job, and with only
/// the busy key's jobs left it finds nothing at once (it does not wait).
async fn a_busy_key_is_skipped_not_waited_for(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(2).await;
    let (db, handle) = (db.db, db.handle);
    let mut ids = Vec::new();
    for (node, key) in [(1, "hot"), (1, "hot"), (2, "cold")] {
        let job = NewJob::new("bump", &Bump { node, seq: 0 }).unwrap();
        match add(&db, job.key(key)).await.unwrap() {
            Enqueued::Added(id) => ids.push(id),
            other => panic!("added: {other:?}"),
        }
    }
    let first_hot = ids[0];
    let (started_tx, mut started) = tokio::sync::mpsc::channel::<()>(1);
    let (release_tx, release) = tokio::sync::watch::channel(false);
    let handlers = Jobs::new().handle(
        "bump",
        at_once(1),
        jobs::handler(move |tx, job: Job<Bump>| {
            let (started_tx, mut release) = (started_tx.clone(), release.clone());
            Box::pin(async move {
                // Only the hot key's first job holds on, until the test lets it go.
                if job.id == first_hot {
                    started_tx.send(()).await.unwrap();
                    release.wait_for(|go| *go).await.unwrap();
                }
                bump(tx, job.payload.node).await?;
                Ok(())
            })
        }),
    );
    let session = Session::new(&handle);
    let first = Worker::new(session.clone(), handlers.clone());
    let holder = tokio::spawn(async move { first.run_one().await.unwrap() });
    started.recv().await.unwrap();
    // The hot key's first job runs and holds its key: the other worker gets the cold job…
    let other = Worker::new(session, handlers);
    let bounded = Duration::from_secs(30);
    let run = tokio::time::timeout(bounded, other.run_one())
        .await
        .expect("a busy key is skipped, not waited for")
        .unwrap()
        .expect("the cold key's job");
    assert_eq!((run.id, &run.outcome), (ids[2], &JobOutcome::Completed));
    assert_eq!(db_score(&db, 2).await, 1);
    // …then nothing, at once: the hot key's second job waits for its first.
    let next = tokio::time::timeout(bounded, other.run_one())
        .await
        .expect("a busy key is skipped, not waited for")
        .unwrap();
    assert!(
        next.is_none(),
        "the busy key's second job was handed out: {next:?}"
    );
    release_tx.send(true).unwrap();
    assert_eq!(
        holder.await.unwrap().unwrap().outcome,
        JobOutcome::Completed
    );
    let run = other
        .run_one()
        .await
        .unwrap()
        .expect("the hot key's second job");
    assert_eq!((run.id, &run.outcome), (ids[1], &JobOutcome::Completed));
    assert_eq!(db_score(&db, 1).await, 2);
}

async fn db_score(db: &DatabaseConnection, node: i32) -> i64 {
    let score = bigint(db, "score");
    number(db, &format!("SELECT {score} FROM node WHERE id = {node}")).await
}

// SQLite has one writer: there a running job's transaction excludes every other worker (see
// the module docs), so this scenario is for the databases with row locks.
on_databases! {
    a_busy_key_is_skipped_postgres: a_busy_key_is_skipped_not_waited_for, postgres;
    a_busy_key_is_skipped_mysql: a_busy_key_is_skipped_not_waited_for, mysql;
}

// ------------------------------------------------------------------------- handler forms

/// A handler as an `async fn` item.
async fn bump_by_fn(tx: &Tx, job: Job<Bump>) -> Result<(), ApplyError> {
    bump(tx, job.payload.node).await?;
    Ok(())
}

/// A handler with state: a type of the user's own.
struct Counting {
    ran: Arc<AtomicUsize>,
}

impl jobs::Handler<Bump> for Counting {
    async fn run(&self, tx: &Tx, job: Job<Bump>) -> Result<(), ApplyError> {
        bump(tx, job.payload.node).await?;
        self.ran.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// The user's own error type, found again by `retry_if`.
#[derive(Debug, thiserror::Error)]
#[error("the card was declined ({0})")]
struct Declined(u32);

async fn every_handler_form_runs_and_retry_if_sees_the_error_typed(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let ran = Arc::new(AtomicUsize::new(0));
    // Kept in a variable before it is registered.
    let stored = async |tx: &Tx, job: Job<Bump>| -> Result<(), ApplyError> {
        bump(tx, job.payload.node).await?;
        Ok(())
    };
    let seen = Arc::clone(&ran);
    let boxed = jobs::handler(move |tx, job: Job<Bump>| {
        let seen = Arc::clone(&seen);
        Box::pin(async move {
            bump(tx, job.payload.node).await?;
            seen.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    });
    let checked: Arc<Mutex<Vec<Option<u32>>>> = Arc::default();
    let seen_errors = Arc::clone(&checked);
    let declines = at_once(5).retry_if(move |error| {
        let declined = error.downcast_ref::<Declined>().map(|d| d.0);
        seen_errors.lock().unwrap().push(declined);
        !error.is::<Declined>()
    });
    let handlers = Jobs::new()
        .handle("fn", at_once(1), bump_by_fn)
        .handle("stored", at_once(1), stored)
        .handle(
            "state",
            at_once(1),
            Counting {
                ran: Arc::clone(&ran),
            },
        )
        .handle("boxed", at_once(1), boxed)
        .handle("declined", declines, async |_tx: &Tx, job: Job<Bump>| {
            if job.attempt == 1 {
                return Err(ApplyError::msg("the service is down"));
            }
            Err(Declined(job.payload.seq).into())
        });
    for kind in ["fn", "stored", "state", "boxed"] {
        add(&db, NewJob::new(kind, &Bump { node: 1, seq: 0 }).unwrap())
            .await
            .unwrap();
    }
    add(
        &db,
        NewJob::new("declined", &Bump { node: 1, seq: 7 }).unwrap(),
    )
    .await
    .unwrap();
    let worker = Worker::new(Session::new(&handle), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    let completed = runs
        .iter()
        .filter(|run| run.outcome == JobOutcome::Completed)
        .count();
    assert_eq!(completed, 4, "{runs:?}");
    assert_eq!(
        total_score(&db).await,
        4,
        "each form's write committed once"
    );
    assert_eq!(
        ran.load(Ordering::SeqCst),
        2,
        "the stateful handlers ran once each"
    );
    // The first attempt's error retried; the second was the user's own type, found again by
    // `retry_if`, and failed the job at once.
    assert_eq!(*checked.lock().unwrap(), [None, Some(7)]);
    let failed = jobs::list(&handle, jobs::JobState::Failed, 10)
        .await
        .unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].attempts, 2);
    assert!(
        failed[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("declined (7)")
    );
}

on_databases! {
    handler_forms_sqlite: every_handler_form_runs_and_retry_if_sees_the_error_typed, sqlite;
    handler_forms_postgres: every_handler_form_runs_and_retry_if_sees_the_error_typed, postgres;
    handler_forms_mysql: every_handler_form_runs_and_retry_if_sees_the_error_typed, mysql;
}

// ----------------------------------------------------------------------- unknown kinds

/// Two services (or an old and a new version) share the job table: each worker takes only the
/// kinds it has handlers for. A job of a kind the first does not know waits, even at the head
/// of its key (the key's later jobs wait behind it), until a worker that knows it runs it.
async fn a_kind_a_worker_does_not_know_waits_for_one_that_does(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let bump = |seq| Bump { node: 1, seq };
    add(&db, NewJob::new("new-kind", &bump(0)).unwrap().key("k"))
        .await
        .unwrap();
    add(&db, NewJob::new("bump", &bump(1)).unwrap().key("k"))
        .await
        .unwrap();
    add(&db, NewJob::new("bump", &bump(2)).unwrap())
        .await
        .unwrap();
    let old = Worker::new(Session::new(&handle), bump_jobs(at_once(1))).with_batch(4);
    let runs = old.run_until_idle().await.unwrap();
    let ran: Vec<(&str, u32)> = runs.iter().map(|r| (r.kind.as_str(), r.attempt)).collect();
    assert_eq!(ran, [("bump", 1)], "only the unkeyed bump: {runs:#?}");
    let waiting = jobs::list(&handle, jobs::JobState::Waiting, 10)
        .await
        .unwrap();
    let waiting: Vec<&str> = waiting.iter().map(|job| job.kind.as_str()).collect();
    assert_eq!(
        waiting,
        ["new-kind", "bump"],
        "the new kind and the bump behind it wait"
    );
    assert_eq!(jobs_in(&db, 3).await, 0, "nothing failed");
    // The new version's worker knows both kinds: the key drains in order.
    let new = bump_jobs(at_once(1)).handle("new-kind", at_once(1), bump_by_fn);
    let runs = Worker::new(Session::new(&handle), new)
        .run_until_idle()
        .await
        .unwrap();
    let ran: Vec<&str> = runs.iter().map(|r| r.kind.as_str()).collect();
    assert_eq!(ran, ["new-kind", "bump"]);
    assert!(runs.iter().all(|r| r.outcome == JobOutcome::Completed));
    assert_eq!(total_score(&db).await, 3, "every job's write once");
    assert_eq!(jobs_in(&db, 2).await, 3);
    // A worker with no handlers takes nothing.
    add(&db, NewJob::new("bump", &bump(3)).unwrap())
        .await
        .unwrap();
    let idle = Worker::new(Session::new(&handle), Jobs::new());
    assert!(idle.run_until_idle().await.unwrap().is_empty());
    assert_eq!(jobs_in(&db, 0).await, 1);
}

/// Once a worker runs (`Worker::run`), the queue's depth says which kinds it takes: a kind
/// that no running worker takes shows as waiting for one, its job untouched.
async fn a_kind_no_running_worker_takes_shows_in_depth(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let job = |seq| Bump { node: 1, seq };
    add(&db, NewJob::new("orphan", &job(0)).unwrap())
        .await
        .unwrap();
    add(&db, NewJob::new("bump", &job(1)).unwrap())
        .await
        .unwrap();
    // Waits an hour: still in the depth while the worker runs.
    let later = NewJob::new("bump", &job(2)).unwrap();
    add(&db, later.delay(std::time::Duration::from_secs(3600)))
        .await
        .unwrap();
    let (ran, mut done) = tokio::sync::mpsc::unbounded_channel();
    let handlers = Jobs::new().handle(
        "bump",
        at_once(1),
        jobs::handler(move |tx, job: Job<Bump>| {
            let ran = ran.clone();
            Box::pin(async move {
                bump(tx, job.payload.node).await?;
                let _ = ran.send(());
                Ok(())
            })
        }),
    );
    let worker = Worker::new(Session::new(&handle), handlers);
    let (stop, running) = run_in_background(worker);
    // The worker says which kinds it takes before its first take; it ran the due bump. A kind
    // counts as taken for 30 s after a running worker last said so.
    done.recv().await.expect("the bump ran");
    let _ = stop.send(());
    assert_eq!(running.await.unwrap(), 1);
    let depth = jobs::depth(&handle).await.unwrap();
    let orphan = depth
        .iter()
        .find(|d| d.kind == "orphan")
        .expect("the orphan waits");
    assert!(!orphan.handled, "no running worker takes it: {orphan:?}");
    assert_eq!(orphan.waiting, 1);
    let later = depth
        .iter()
        .find(|d| d.kind == "bump")
        .expect("the later bump waits");
    assert!(later.handled, "the running worker takes it: {later:?}");
    assert_eq!((later.waiting, later.due), (1, 0));
    assert_eq!(
        total_score(&db).await,
        1,
        "the bump's write once, the orphan untouched"
    );
}

on_databases! {
    unknown_kind_waits_sqlite: a_kind_a_worker_does_not_know_waits_for_one_that_does, sqlite;
    no_worker_sqlite: a_kind_no_running_worker_takes_shows_in_depth, sqlite;
    no_worker_postgres: a_kind_no_running_worker_takes_shows_in_depth, postgres;
    no_worker_mysql: a_kind_no_running_worker_takes_shows_in_depth, mysql;
    unknown_kind_waits_postgres: a_kind_a_worker_does_not_know_waits_for_one_that_does, postgres;
    unknown_kind_waits_mysql: a_kind_a_worker_does_not_know_waits_for_one_that_does, mysql;
}

/// Named queues: workers from one `Jobs` narrowed to some kinds take only those, so each
/// queue runs with workers of its own; a kind without a handler is refused.
async fn a_worker_narrowed_to_a_queue_takes_only_its_kinds(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let jobs = Jobs::new()
        .handle("email", at_once(1), bump_by_fn)
        .handle("sms", at_once(1), bump_by_fn)
        .handle("report", at_once(1), bump_by_fn);
    for (seq, kind) in ["email", "report", "sms", "report", "email"]
        .iter()
        .enumerate()
    {
        let seq = u32::try_from(seq).unwrap();
        add(&db, NewJob::new(*kind, &Bump { node: 1, seq }).unwrap())
            .await
            .unwrap();
    }
    let session = Session::new(&handle);
    let refused = Worker::new(session.clone(), jobs.clone()).only(["email", "fax"]);
    assert!(matches!(refused, Err(freshlock::Error::InvalidJob { kind, .. }) if kind == "fax"));
    let reports = Worker::new(session.clone(), jobs.clone())
        .only(["report"])
        .unwrap();
    let runs = reports.drain(Duration::ZERO).await.unwrap();
    let kinds: Vec<&str> = runs.iter().map(|r| r.kind.as_str()).collect();
    assert_eq!(kinds, ["report", "report"]);
    assert_eq!(total_score(&db).await, 2);
    let messages = Worker::new(session, jobs).only(["sms", "email"]).unwrap();
    let runs = messages.run_until_idle().await.unwrap();
    let kinds: Vec<&str> = runs.iter().map(|r| r.kind.as_str()).collect();
    assert_eq!(kinds, ["email", "sms", "email"]);
    assert_eq!(total_score(&db).await, 5, "every job's write once");
}

on_databases! {
    queues_sqlite: a_worker_narrowed_to_a_queue_takes_only_its_kinds, sqlite;
    queues_postgres: a_worker_narrowed_to_a_queue_takes_only_its_kinds, postgres;
    queues_mysql: a_worker_narrowed_to_a_queue_takes_only_its_kinds, mysql;
}

// ------------------------------------------------------------------ retries and bad input

async fn failures_retry_then_fail_and_roll_back_their_writes(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    // A failing handler's attempt spoils the batch's transaction (no savepoint per job unless
    // one fails): it rolls back and the batch runs again with savepoints, recording the
    // failure instead of running that handler a second time. Counted per kind.
    let calls: Arc<[AtomicUsize; 3]> = Arc::default();
    let counted = |i: usize| {
        let calls = Arc::clone(&calls);
        move || calls[i].fetch_add(1, Ordering::SeqCst)
    };
    let (flaky_call, panics_call, permanent_call) = (counted(0), counted(1), counted(2));
    let handlers = Jobs::new()
        .handle(
            "flaky",
            at_once(3),
            jobs::handler(move |tx, job: Job<Bump>| {
                flaky_call();
                Box::pin(async move {
                    // Written, then rolled back with the failed attempt.
                    bump(tx, job.payload.node).await?;
                    Err(freshlock::ApplyError::msg(format!(
                        "attempt {} failed",
                        job.attempt
                    )))
                })
            }),
        )
        .handle(
            "panics",
            at_once(2),
            jobs::handler(move |_tx, job: Job<Bump>| {
                panics_call();
                Box::pin(async move {
                    assert!(job.attempt > 5, "boom on attempt {}", job.attempt);
                    Ok(())
                })
            }),
        )
        .handle(
            "permanent",
            at_once(5).retry_if(|e| !e.to_string().contains("permanent")),
            jobs::handler(move |_tx, _job: Job<Bump>| {
                permanent_call();
                Box::pin(async move { Err(freshlock::ApplyError::msg("a permanent error")) })
            }),
        )
        .handle(
            "bump",
            at_once(1),
            jobs::handler(|tx, job: Job<Bump>| {
                Box::pin(async move {
                    bump(tx, job.payload.node).await?;
                    Ok(())
                })
            }),
        );
    let bump_one = Bump { node: 1, seq: 0 };
    for kind in ["flaky", "panics", "permanent", "nobody-handles-this"] {
        add(&db, NewJob::new(kind, &bump_one).unwrap())
            .await
            .unwrap();
    }
    // A payload of the wrong shape for its kind.
    add(&db, NewJob::new("bump", &"not a bump").unwrap())
        .await
        .unwrap();
    // And a good job after all of them: the worker gets there.
    add(&db, NewJob::new("bump", &bump_one).unwrap())
        .await
        .unwrap();
    // In batches: each failing job rolls back alone, the others of its batch commit.
    let worker = Worker::new(Session::new(&handle), handlers).with_batch(4);
    let runs = worker.run_until_idle().await.unwrap();
    let by_kind = |kind: &str| -> Vec<&JobOutcome> {
        (runs.iter())
            .filter(|r| r.kind == kind)
            .map(|r| &r.outcome)
            .collect()
    };
    let flaky = by_kind("flaky");
    assert_eq!(flaky.len(), 3, "{runs:#?}");
    assert!(
        matches!(flaky[0], JobOutcome::Retrying { failure: JobFailure::Handler(m), .. } if m == "attempt 1 failed")
    );
    assert!(
        matches!(flaky[2], JobOutcome::Failed(JobFailure::Handler(m)) if m == "attempt 3 failed")
    );
    let panics = by_kind("panics");
    assert_eq!(panics.len(), 2, "{runs:#?}");
    assert!(
        matches!(panics[0], JobOutcome::Retrying { failure: JobFailure::Panicked(m), .. } if m == "boom on attempt 1")
    );
    assert!(matches!(
        panics[1],
        JobOutcome::Failed(JobFailure::Panicked(_))
    ));
    assert!(matches!(
        by_kind("permanent")[..],
        [JobOutcome::Failed(JobFailure::Handler(_))]
    ));
    // A kind this worker has no handler for is not taken: it waits for a worker that has.
    assert!(by_kind("nobody-handles-this").is_empty(), "{runs:#?}");
    assert_eq!(jobs_in(&db, 0).await, 1);
    let bumps = by_kind("bump");
    assert!(matches!(
        bumps[0],
        JobOutcome::Failed(JobFailure::BadPayload { .. })
    ));
    assert_eq!(bumps[1], &JobOutcome::Completed);
    // Each failing handler ran once per attempt, never twice for one.
    let calls: Vec<usize> = calls.iter().map(|c| c.load(Ordering::SeqCst)).collect();
    assert_eq!(calls, [3, 2, 1], "handler runs of flaky, panics, permanent");
    // Only the good job's write is in the database: every failed attempt's was rolled back.
    assert_eq!(total_score(&db).await, 1);
    assert_eq!(jobs_in(&db, 3).await, 4);
    assert_eq!(jobs_in(&db, 2).await, 1);
    let txn = db.begin().await.unwrap();
    let kept = txn
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT last_error, attempts FROM freshlock_job WHERE state = 3 ORDER BY id LIMIT 1",
        ))
        .await
        .unwrap()
        .unwrap();
    txn.commit().await.unwrap();
    let error: String = kept.try_get("", "last_error").unwrap();
    assert_eq!(error, "the handler failed: attempt 3 failed");
    assert_eq!(kept.try_get::<i32>("", "attempts").unwrap(), 3);
}

on_databases! {
    failures_retry_then_fail_sqlite: failures_retry_then_fail_and_roll_back_their_writes, sqlite;
    failures_retry_then_fail_postgres: failures_retry_then_fail_and_roll_back_their_writes, postgres;
    failures_retry_then_fail_mysql: failures_retry_then_fail_and_roll_back_their_writes, mysql;
}

#[tokio::test]
async fn a_retry_waits_for_its_backoff() {
    let test = freshlock::testing::TestDatabase::with_migrator::<migration::Migrator>()
        .await
        .unwrap();
    let db = test.connection().clone();
    let policy = RetryPolicy::default()
        .with_max_attempts(2)
        .with_backoff(Duration::from_secs(3600), Duration::from_secs(3600));
    let handlers = Jobs::new().handle(
        "fails",
        policy,
        jobs::handler(|_tx, _job: Job<()>| {
            Box::pin(async move { Err(freshlock::ApplyError::msg("no")) })
        }),
    );
    add(&db, NewJob::new("fails", &()).unwrap()).await.unwrap();
    let worker = Worker::new(Session::new(db.clone()), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    let [run] = &runs[..] else {
        panic!("one attempt: {runs:?}")
    };
    let JobOutcome::Retrying { after, .. } = &run.outcome else {
        panic!("retrying: {run:?}")
    };
    assert!(*after <= Duration::from_secs(3600));
    // The retry is due only after its delay (full jitter: up to an hour; a zero draw is as
    // likely as any other, so look at the stored due time rather than the reported delay).
    let due_later = number(
        &db,
        "SELECT COUNT(*) FROM freshlock_job WHERE state = 0 AND attempts = 1",
    )
    .await;
    assert_eq!(due_later, 1);
    if *after >= Duration::from_secs(1) {
        assert!(worker.run_one().await.unwrap().is_none());
    }
}

/// A drain runs what is due within its horizon — retries after their backoff, delayed jobs —
/// and nothing beyond it, nor any kind it has no handler for.
async fn a_drain_runs_what_is_due_within_its_horizon(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let hour = Duration::from_secs(3600);
    let policy = RetryPolicy::default()
        .with_max_attempts(3)
        .with_backoff(hour, hour);
    let handlers =
        bump_jobs(at_once(1)).handle("fails", policy, async |_tx: &Tx, _job: Job<()>| {
            Err(ApplyError::msg("no"))
        });
    add(&db, NewJob::new("fails", &()).unwrap()).await.unwrap();
    let bump_one = Bump { node: 1, seq: 0 };
    add(
        &db,
        NewJob::new("bump", &bump_one).unwrap().delay(hour * 48),
    )
    .await
    .unwrap();
    add(&db, NewJob::new("elsewhere", &()).unwrap())
        .await
        .unwrap();
    let worker = Worker::new(Session::new(&handle), handlers);
    // Two days ahead: every retry of the failing job (each at most two hours after the last),
    // not the bump due in 48 hours.
    let runs = worker.drain(hour * 47).await.unwrap();
    let outcomes: Vec<(&str, u32)> = runs.iter().map(|r| (r.kind.as_str(), r.attempt)).collect();
    assert_eq!(
        outcomes,
        [("fails", 1), ("fails", 2), ("fails", 3)],
        "{runs:#?}"
    );
    assert!(matches!(runs[2].outcome, JobOutcome::Failed(_)));
    assert_eq!(total_score(&db).await, 0);
    let runs = worker.drain(hour * 49).await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(total_score(&db).await, 1, "the delayed bump ran once");
    let waiting = jobs::list(&handle, jobs::JobState::Waiting, 10)
        .await
        .unwrap();
    assert_eq!(waiting.len(), 1);
    assert_eq!(
        waiting[0].kind, "elsewhere",
        "a kind without a handler is left as it was"
    );
}

on_databases! {
    drain_sqlite: a_drain_runs_what_is_due_within_its_horizon, sqlite;
    drain_postgres: a_drain_runs_what_is_due_within_its_horizon, postgres;
    drain_mysql: a_drain_runs_what_is_due_within_its_horizon, mysql;
}

// ------------------------------------------------------------------------------ bulk enqueue

/// `enqueue_many` (1,100 jobs: two statements): every unique key honoured (against unfinished
/// jobs and within the call), rolled back with its transaction, and each added job's effect in
/// the database exactly once, a key's jobs in the order given.
async fn many_jobs_enqueued_at_once_run_once_each_in_order(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    const N: u32 = 1_100;
    add(
        &db,
        NewJob::new("ordered", &Bump { node: 1, seq: 0 })
            .unwrap()
            .unique("u:0"),
    )
    .await
    .unwrap();
    let batch = || {
        (1..=N).map(|seq| {
            let job = NewJob::new("ordered", &Bump { node: 1, seq }).unwrap();
            // Three keys, hot ones; every 100th job's unique key repeats the one before it;
            // job 1 repeats the waiting job's.
            let job = job.key(format!("k{}", seq % 3));
            match seq {
                1 => job.unique("u:0"),
                s if s % 100 == 0 => job.unique(format!("u:{}", s - 1)),
                s if s % 100 == 99 => job.unique(format!("u:{s}")),
                _ => job,
            }
        })
    };
    let txn = db.begin().await.unwrap();
    jobs::enqueue_many(&txn, batch()).await.unwrap();
    txn.rollback().await.unwrap();
    assert_eq!(
        number(&db, "SELECT COUNT(*) FROM freshlock_job").await,
        1,
        "rolled back"
    );
    let txn = db.begin().await.unwrap();
    let done = jobs::enqueue_many(&txn, batch()).await.unwrap();
    txn.commit().await.unwrap();
    let duplicates = 1 + u64::from(N / 100);
    assert_eq!(
        (done.added, done.duplicates),
        (u64::from(N) - duplicates, duplicates)
    );
    assert_eq!(
        number(&db, "SELECT COUNT(*) FROM freshlock_job").await,
        1 + i64::try_from(done.added).unwrap(),
        "every acknowledged job is a row, once"
    );
    // Each key's jobs run in the order given (`seq` grows), each once.
    let (handlers, ran) = recorded_bumps();
    let worker = Worker::new(Session::new(&handle), handlers).with_batch(8);
    let runs = worker.run_until_idle().await.unwrap();
    assert_eq!(runs.len() as u64, done.added + 1);
    assert!(runs.iter().all(|run| run.outcome == JobOutcome::Completed));
    let mut seen: HashMap<String, Vec<u32>> = HashMap::new();
    for (key, bump) in ran.lock().unwrap().iter() {
        seen.entry(key.clone().unwrap_or_default())
            .or_default()
            .push(bump.seq);
    }
    assert_eq!(
        seen.values().map(Vec::len).sum::<usize>() as u64,
        done.added + 1
    );
    for (key, seqs) in seen.iter() {
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "key {key}: {seqs:?}");
    }
    assert_eq!(
        total_score(&db).await,
        i64::try_from(done.added).unwrap() + 1
    );
}

on_databases! {
    enqueue_many_sqlite: many_jobs_enqueued_at_once_run_once_each_in_order, sqlite;
    enqueue_many_postgres: many_jobs_enqueued_at_once_run_once_each_in_order, postgres;
    enqueue_many_mysql: many_jobs_enqueued_at_once_run_once_each_in_order, mysql;
}

// ------------------------------------------------------------------------- batch order

/// Each job's key and payload, in the order the handlers ran them.
type Ran = Arc<Mutex<Vec<(Option<String>, Bump)>>>;

/// Handlers of kind `ordered` that bump the job's node and record it in [`Ran`].
fn recorded_bumps() -> (Jobs, Ran) {
    let ran: Ran = Arc::default();
    let record = Arc::clone(&ran);
    let handlers = Jobs::new().handle(
        "ordered",
        at_once(1),
        jobs::handler(move |tx, job: Job<Bump>| {
            let record = Arc::clone(&record);
            Box::pin(async move {
                bump(tx, job.payload.node).await?;
                record.lock().unwrap().push((job.key, job.payload));
                Ok(())
            })
        }),
    );
    (handlers, ran)
}

/// A batch runs its jobs in one order every worker shares (kind, key, payload), not the order
/// it took them in: jobs enqueued for rows 9, 8, …, 1 lock rows 1 … 9, as every other batch
/// does, so batches that share rows wait for each other instead of deadlocking (W2 with
/// batches of 32 on 100 rows: 888 deadlocks on PostgreSQL before, none after; BENCHMARKS).
async fn a_batch_runs_its_jobs_in_one_shared_order(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(9).await;
    let (db, handle) = (db.db, db.handle);
    for node in (1..=9).rev() {
        add(&db, NewJob::new("ordered", &Bump { node, seq: 0 }).unwrap())
            .await
            .unwrap();
    }
    let (handlers, ran) = recorded_bumps();
    let worker = Worker::new(Session::new(&handle), handlers).with_batch(9);
    let runs = worker.run_batch().await.unwrap();
    assert_eq!(runs.len(), 9, "one batch took them all");
    assert!(runs.iter().all(|run| run.outcome == JobOutcome::Completed));
    let nodes: Vec<i32> = ran.lock().unwrap().iter().map(|(_, b)| b.node).collect();
    assert_eq!(nodes, (1..=9).collect::<Vec<_>>());
    assert_eq!(total_score(&db).await, 9, "each job's write once");
}

on_databases! {
    batch_order_sqlite: a_batch_runs_its_jobs_in_one_shared_order, sqlite;
    batch_order_postgres: a_batch_runs_its_jobs_in_one_shared_order, postgres;
    batch_order_mysql: a_batch_runs_its_jobs_in_one_shared_order, mysql;
}

// ------------------------------------------------------------------------- unique jobs

async fn a_pending_unique_key_is_a_duplicate(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let job = || {
        NewJob::new("bump", &Bump { node: 1, seq: 0 })
            .unwrap()
            .unique("spam:17")
    };
    let Enqueued::Added(first) = add(&db, job()).await.unwrap() else {
        panic!("added");
    };
    assert_eq!(
        add(&db, job()).await.unwrap(),
        Enqueued::Duplicate {
            existing: Some(first)
        }
    );
    // A duplicate does not abort the caller's transaction: it goes on and commits.
    let txn = db.begin().await.unwrap();
    assert!(matches!(
        jobs::enqueue(&txn, job()).await.unwrap(),
        Enqueued::Duplicate { .. }
    ));
    let other = NewJob::new("bump", &Bump { node: 1, seq: 1 })
        .unwrap()
        .unique("spam:18");
    assert!(matches!(
        jobs::enqueue(&txn, other).await.unwrap(),
        Enqueued::Added(_)
    ));
    txn.commit().await.unwrap();
    let worker = Worker::new(Session::new(&handle), bump_jobs(RetryPolicy::default()));
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 2);
    assert_eq!(total_score(&db).await, 2);
    // Finished: the unique key is free again.
    assert!(matches!(
        add(&db, job()).await.unwrap(),
        Enqueued::Added(id) if id != first
    ));
}

on_databases! {
    unique_jobs_sqlite: a_pending_unique_key_is_a_duplicate, sqlite;
    unique_jobs_postgres: a_pending_unique_key_is_a_duplicate, postgres;
    unique_jobs_mysql: a_pending_unique_key_is_a_duplicate, mysql;
}

// ------------------------------------------------------------------------- hostile strings

fn hostile() -> Vec<String> {
    vec![
        "a".to_owned(),
        "A".to_owned(),
        "a ".to_owned(),
        "a\0b".to_owned(),
        "a\0c".to_owned(),
        "'; DROP TABLE freshlock_job; --".to_owned(),
        "\"\\`%_?$1".to_owned(),
        "é".to_owned(),
        "e\u{301}".to_owned(),
        "🦀".to_owned(),
        "x".repeat(10_000),
        format!("{}y", "x".repeat(9_999)),
    ]
}

async fn keys_kinds_and_unique_keys_are_byte_exact(db: Option<TestDb>) {
    let Some(db) = db else { return };
    let (db, handle) = (db.db, db.handle);
    // (kind, key, payload) as each handler got them.
    type Got = (String, Option<String>, String);
    let seen: Arc<Mutex<Vec<Got>>> = Arc::default();
    let mut handlers = Jobs::new();
    for kind in hostile() {
        let (seen, name) = (Arc::clone(&seen), kind.clone());
        handlers = handlers.handle(
            kind,
            at_once(1),
            jobs::handler(move |_tx, job: Job<String>| {
                let (seen, name) = (Arc::clone(&seen), name.clone());
                Box::pin(async move {
                    seen.lock().unwrap().push((name, job.key, job.payload));
                    Ok(())
                })
            }),
        );
    }
    for value in hostile() {
        let job = NewJob::new(value.clone(), &value)
            .unwrap()
            .key(value.clone())
            .unique(value.clone());
        assert!(matches!(
            add(&db, job.clone()).await.unwrap(),
            Enqueued::Added(_)
        ));
        // Each unique key is distinct from every other byte for byte, and equal to itself.
        assert!(matches!(
            add(&db, job).await.unwrap(),
            Enqueued::Duplicate { existing: Some(_) }
        ));
    }
    let worker = Worker::new(Session::new(&handle), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    assert!(
        runs.iter().all(|r| r.outcome == JobOutcome::Completed),
        "{runs:#?}"
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), hostile().len());
    for (kind, key, payload) in seen.iter() {
        assert_eq!(Some(kind), key.as_ref());
        assert_eq!(kind, payload);
    }
}

on_databases! {
    hostile_strings_sqlite: keys_kinds_and_unique_keys_are_byte_exact, sqlite;
    hostile_strings_postgres: keys_kinds_and_unique_keys_are_byte_exact, postgres;
    hostile_strings_mysql: keys_kinds_and_unique_keys_are_byte_exact, mysql;
}

#[test]
fn a_payload_that_does_not_serialize_is_a_typed_error() {
    let mut map = HashMap::new();
    map.insert((1, 2), "tuple keys are not JSON object keys");
    assert!(matches!(
        NewJob::new("k", &map),
        Err(freshlock::Error::InvalidJob { kind, .. }) if kind == "k"
    ));
}

// ------------------------------------------------------------------------ graceful shutdown

/// A shutdown that comes while a job runs lets it finish (its write and completion commit),
/// and nothing new is taken after it.
#[tokio::test]
async fn a_graceful_shutdown_finishes_the_running_job_and_takes_no_other() {
    let (_test, db) = memory_with_node().await;
    for seq in 0..2 {
        add(&db, NewJob::new("bump", &Bump { node: 1, seq }).unwrap())
            .await
            .unwrap();
    }
    let (started_tx, mut started) = tokio::sync::mpsc::channel::<()>(1);
    let (release_tx, release) = tokio::sync::watch::channel(false);
    let handlers = Jobs::new().handle(
        "bump",
        at_once(1),
        jobs::handler(move |tx, job: Job<Bump>| {
            let (started_tx, mut release) = (started_tx.clone(), release.clone());
            Box::pin(async move {
                started_tx.send(()).await.unwrap();
                release.wait_for(|go| *go).await.unwrap();
                bump(tx, job.payload.node).await?;
                Ok(())
            })
        }),
    );
    let worker = Worker::new(Session::new(db.clone()), handlers);
    let (stop_tx, running) = run_in_background(worker);
    started.recv().await.unwrap();
    stop_tx.send(()).unwrap();
    release_tx.send(true).unwrap();
    assert_eq!(
        running.await.unwrap(),
        1,
        "the running job finished; no other was taken"
    );
    assert_eq!(total_score(&db).await, 1);
    assert_eq!(jobs_in(&db, 2).await, 1);
    assert_eq!(jobs_in(&db, 0).await, 1);
}

/// `worker.run` in a task of its own: the sender stops it, the task returns how many ran.
/// A worker whose database has no job table (migrations not run) stops and says why, rather
/// than logging the same failure forever.
#[tokio::test]
async fn a_worker_stops_when_the_job_table_is_missing() {
    let empty = freshlock::testing::TestDatabase::empty().await.unwrap();
    let worker = Worker::new(
        Session::new(empty.connection().clone()),
        bump_jobs(at_once(1)),
    );
    let stopped = worker.run(std::future::pending()).await;
    let error = stopped.expect_err("no job table");
    assert!(error.to_string().contains("freshlock_job"), "{error}");
}

// ------------------------------------------------------------------------- the operator

/// A filter by kind, key and state reads in a transaction too (a test's own, before it
/// commits), with the jobs' timestamps.
async fn jobs_are_listed_by_kind_key_and_state_on_any_connection(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let bump_one = |seq| NewJob::new("bump", &Bump { node: 1, seq }).unwrap();
    add(&db, bump_one(0).key("a")).await.unwrap();
    let worker = Worker::new(Session::new(&handle), bump_jobs(at_once(1)));
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 1);
    let txn = db.begin().await.unwrap();
    for job in [bump_one(1).key("a"), bump_one(2).key("b"), bump_one(3)] {
        jobs::enqueue(&txn, job).await.unwrap();
    }
    jobs::enqueue(&txn, NewJob::new("other", &()).unwrap().key("a"))
        .await
        .unwrap();
    let filter = jobs::JobFilter::new;
    let ids = |jobs: Vec<jobs::JobInfo>| {
        jobs.iter()
            .map(|j| (j.kind.clone(), j.key.clone()))
            .collect::<Vec<_>>()
    };
    let a = Some("a".to_owned());
    let bump_a = filter().kind("bump").key("a").list(&txn, 10).await.unwrap();
    assert_eq!(bump_a.len(), 2, "{bump_a:#?}");
    let (done, waiting) = (&bump_a[0], &bump_a[1]);
    assert_eq!(
        (done.state, waiting.state),
        (jobs::JobState::Done, jobs::JobState::Waiting)
    );
    // One read of the database clock for both (PostgreSQL's `clock_timestamp()` moves within a
    // statement).
    assert_eq!(done.created_at_ms, done.run_at_ms, "{done:#?}");
    assert!(done.finished_at_ms.is_some_and(|at| at >= done.run_at_ms));
    assert_eq!(waiting.finished_at_ms, None);
    let waiting_a = filter()
        .key("a")
        .state(jobs::JobState::Waiting)
        .list(&txn, 10)
        .await
        .unwrap();
    assert_eq!(
        ids(waiting_a),
        [
            ("bump".to_owned(), a.clone()),
            ("other".to_owned(), a.clone())
        ]
    );
    let bumps = filter()
        .kind("bump")
        .state(jobs::JobState::Waiting)
        .list(&txn, 10)
        .await
        .unwrap();
    assert_eq!(bumps.len(), 3);
    assert_eq!(filter().list(&txn, 2).await.unwrap().len(), 2, "the limit");
    let depth = filter().kind("bump").depth(&txn).await.unwrap();
    let waiting: Vec<(Option<String>, u64)> =
        depth.iter().map(|d| (d.key.clone(), d.waiting)).collect();
    assert_eq!(waiting.len(), 3, "{depth:#?}");
    assert_eq!(waiting.iter().map(|w| w.1).sum::<u64>(), 3);
    assert!(depth.iter().all(|d| d.kind == "bump"));
    txn.rollback().await.unwrap();
    // Outside a transaction through the application's handle: marked when a transaction pooler
    // stands in front, where a plain pool's lone statement would be the caller's own.
    let left = jobs::list(&handle, jobs::JobState::Waiting, 10)
        .await
        .unwrap();
    assert!(left.is_empty(), "{left:#?}");
}

on_databases! {
    filtered_list_sqlite: jobs_are_listed_by_kind_key_and_state_on_any_connection, sqlite;
    filtered_list_postgres: jobs_are_listed_by_kind_key_and_state_on_any_connection, postgres;
    filtered_list_mysql: jobs_are_listed_by_kind_key_and_state_on_any_connection, mysql;
}

async fn depth_list_retry_and_discard(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let bump_one = || NewJob::new("bump", &Bump { node: 1, seq: 0 }).unwrap();
    for key in ["ham:1", "ham:1", "ham:2"] {
        add(&db, bump_one().key(key)).await.unwrap();
    }
    add(&db, bump_one().delay(Duration::from_secs(3600)))
        .await
        .unwrap();
    let Enqueued::Added(doomed) = add(&db, NewJob::new("fails", &()).unwrap().unique("u"))
        .await
        .unwrap()
    else {
        panic!("added");
    };
    let Enqueued::Added(dropped) = add(
        &db,
        NewJob::new("bump", &Bump { node: 1, seq: 9 })
            .unwrap()
            .unique("d"),
    )
    .await
    .unwrap() else {
        panic!("added");
    };
    let depth = jobs::depth(&handle).await.unwrap();
    let of = |kind: &str, key: Option<&str>| {
        let row = depth
            .iter()
            .find(|d| d.kind == kind && d.key.as_deref() == key)
            .unwrap_or_else(|| panic!("{kind} {key:?} in {depth:#?}"));
        (row.waiting, row.due, row.failed)
    };
    // The second job of ham:1 is not due: it waits for the first.
    assert_eq!(of("bump", Some("ham:1")), (2, 1, 0));
    assert_eq!(of("bump", Some("ham:2")), (1, 1, 0));
    assert_eq!(
        of("bump", None),
        (2, 1, 0),
        "one keyless job is due in an hour"
    );
    assert_eq!(of("fails", None), (1, 1, 0));
    // Discarded before it ran: never runs, its unique key is free again.
    assert!(jobs::discard(&db, dropped).await.unwrap());
    assert!(!jobs::discard(&db, dropped).await.unwrap());
    assert!(matches!(
        add(&db, NewJob::new("other", &()).unwrap().unique("d"))
            .await
            .unwrap(),
        Enqueued::Added(_)
    ));
    let handlers = bump_jobs(at_once(1))
        .handle(
            "fails",
            at_once(1),
            jobs::handler(|_tx, job: Job<()>| {
                Box::pin(async move {
                    if job.attempt == 1 {
                        return Err(freshlock::ApplyError::msg("first time"));
                    }
                    Ok(())
                })
            }),
        )
        .handle(
            "other",
            at_once(1),
            jobs::handler(|_tx, _job: Job<()>| Box::pin(async move { Ok(()) })),
        );
    let worker = Worker::new(Session::new(&handle), handlers);
    worker.run_until_idle().await.unwrap();
    assert_eq!(total_score(&db).await, 3, "the discarded job did not run");
    let failed = jobs::list(&handle, jobs::JobState::Failed, 10)
        .await
        .unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!((failed[0].id, failed[0].attempts), (doomed, 1));
    assert_eq!(failed[0].unique.as_deref(), Some("u"));
    assert_eq!(
        failed[0].last_error.as_deref(),
        Some("the handler failed: first time")
    );
    assert_eq!(
        jobs::depth(&handle)
            .await
            .unwrap()
            .iter()
            .map(|d| d.failed)
            .sum::<u64>(),
        1
    );
    // A failed job's unique key is free: another job takes it, and the retry must wait.
    let Enqueued::Added(taker) = add(&db, NewJob::new("other", &()).unwrap().unique("u"))
        .await
        .unwrap()
    else {
        panic!("added");
    };
    assert_eq!(
        jobs::retry(&db, doomed).await.unwrap(),
        jobs::Retried::Duplicate
    );
    assert!(jobs::discard(&db, taker).await.unwrap());
    assert_eq!(
        jobs::retry(&db, doomed).await.unwrap(),
        jobs::Retried::Waiting
    );
    assert_eq!(
        jobs::retry(&db, doomed).await.unwrap(),
        jobs::Retried::NotFailed
    );
    // Waiting again, it holds its unique key again, and runs (attempts counted from zero).
    assert!(matches!(
        add(&db, NewJob::new("fails", &()).unwrap().unique("u"))
            .await
            .unwrap(),
        Enqueued::Duplicate { existing: Some(id) } if id == doomed
    ));
    let runs = worker.run_until_idle().await.unwrap();
    assert!(
        matches!(&runs[..], [run] if run.id == doomed && run.attempt == 1
        && run.outcome == JobOutcome::Failed(JobFailure::Handler("first time".into())))
    );
    let discarded = jobs::list(&handle, jobs::JobState::Discarded, 10)
        .await
        .unwrap();
    assert_eq!(
        discarded.iter().map(|j| j.id).collect::<Vec<_>>(),
        [dropped, taker]
    );
}

on_databases! {
    operator_sqlite: depth_list_retry_and_discard, sqlite;
    operator_postgres: depth_list_retry_and_discard, postgres;
    operator_mysql: depth_list_retry_and_discard, mysql;
}

/// Two kinds longer than MySQL's `max_sort_length` (1,024 bytes) that differ only after it are
/// two kinds in the depth, each with its own counts, and each kind's rows are next to each
/// other (`record_depth` sums adjacent rows).
async fn long_kinds_are_counted_apart(db: Option<TestDb>) {
    let Some(db) = db else { return };
    let (db, handle) = (db.db, db.handle);
    let stem = "k".repeat(1_100);
    let (a, b) = (format!("{stem}a"), format!("{stem}b"));
    for (kind, key) in [(&a, "x"), (&b, "x"), (&a, "y"), (&a, "y"), (&b, "z")] {
        add(&db, NewJob::new(kind.as_str(), &()).unwrap().key(key))
            .await
            .unwrap();
    }
    let depth = jobs::depth(&handle).await.unwrap();
    let rows: Vec<(bool, Option<&str>, u64)> = depth
        .iter()
        .map(|d| (d.kind == a, d.key.as_deref(), d.waiting))
        .collect();
    assert!(
        depth.iter().all(|d| d.kind == a || d.kind == b),
        "the kinds come back whole"
    );
    let mut expected = vec![
        (true, Some("x"), 1),
        (true, Some("y"), 2),
        (false, Some("x"), 1),
        (false, Some("z"), 1),
    ];
    let mut sorted = rows.clone();
    sorted.sort_unstable();
    expected.sort_unstable();
    assert_eq!(sorted, expected, "{rows:?}");
    let firsts: Vec<bool> = rows.iter().map(|r| r.0).collect();
    let mut runs = firsts.clone();
    runs.dedup();
    assert_eq!(runs.len(), 2, "each kind's rows together: {firsts:?}");
}

on_databases! {
    long_kinds_apart_sqlite: long_kinds_are_counted_apart, sqlite;
    long_kinds_apart_postgres: long_kinds_are_counted_apart, postgres;
    long_kinds_apart_mysql: long_kinds_are_counted_apart, mysql;
}

/// `jobs::prune` deletes finished jobs only — done and discarded, failed ones when asked — and
/// only those that finished long enough ago; what ran stays applied, and a key whose finished
/// jobs were deleted still runs its next job.
async fn prune_deletes_finished_jobs_only(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let bump_one = || NewJob::new("bump", &Bump { node: 1, seq: 0 }).unwrap();
    for _ in 0..3 {
        add(&db, bump_one().key("ham:1")).await.unwrap();
    }
    add(&db, bump_one().delay(Duration::from_secs(3600)))
        .await
        .unwrap();
    add(&db, NewJob::new("fails", &()).unwrap()).await.unwrap();
    let Enqueued::Added(dropped) = add(&db, bump_one()).await.unwrap() else {
        panic!("added");
    };
    assert!(jobs::discard(&db, dropped).await.unwrap());
    let handlers = bump_jobs(at_once(1)).handle(
        "fails",
        at_once(1),
        jobs::handler(|_tx, _job: Job<()>| {
            Box::pin(async move { Err(freshlock::ApplyError::msg("always")) })
        }),
    );
    let worker = Worker::new(Session::new(&handle), handlers);
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 4);
    let count = |state| {
        let handle = handle.clone();
        async move { jobs::list(&handle, state, 100).await.unwrap().len() }
    };
    assert_eq!(
        (
            count(jobs::JobState::Done).await,
            count(jobs::JobState::Failed).await
        ),
        (3, 1)
    );

    let hour = Duration::from_secs(3600);
    assert_eq!(
        jobs::prune(&handle, hour, jobs::Prune::FinishedAndFailed)
            .await
            .unwrap(),
        0,
        "all finished just now"
    );
    assert_eq!(
        jobs::prune(&handle, Duration::ZERO, jobs::Prune::Finished)
            .await
            .unwrap(),
        4
    );
    assert_eq!(count(jobs::JobState::Done).await, 0);
    assert_eq!(count(jobs::JobState::Discarded).await, 0);
    assert_eq!(
        count(jobs::JobState::Failed).await,
        1,
        "failed jobs stay unless asked"
    );
    assert_eq!(
        count(jobs::JobState::Waiting).await,
        1,
        "the delayed job waits"
    );
    assert_eq!(
        jobs::prune(&handle, Duration::ZERO, jobs::Prune::FinishedAndFailed)
            .await
            .unwrap(),
        1
    );
    assert_eq!(count(jobs::JobState::Failed).await, 0);
    assert_eq!(
        count(jobs::JobState::Waiting).await,
        1,
        "never a waiting job"
    );
    assert_eq!(total_score(&db).await, 3, "what ran stays applied");

    // The key's finished jobs are gone: its next job runs all the same.
    add(&db, bump_one().key("ham:1")).await.unwrap();
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 1);
    assert_eq!(total_score(&db).await, 4);
}

on_databases! {
    prune_sqlite: prune_deletes_finished_jobs_only, sqlite;
    prune_postgres: prune_deletes_finished_jobs_only, postgres;
    prune_mysql: prune_deletes_finished_jobs_only, mysql;
}

/// A prune beside a running job neither waits for it nor holds up the other workers: it locks
/// only the finished jobs it deletes. (A `DELETE … WHERE id IN (SELECT …)` locked every row it
/// read on MariaDB, waited for the running job's row, and takes skipped the rows it held.)
/// Not on SQLite, whose one writer a running job holds.
async fn a_prune_beside_a_running_job_holds_nothing_up(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let bump_one = |priority| {
        NewJob::new("bump", &Bump { node: 1, seq: 0 })
            .unwrap()
            .priority(priority)
    };
    for _ in 0..4 {
        add(&db, bump_one(0)).await.unwrap();
    }
    let done = Worker::new(Session::new(&handle), bump_jobs(at_once(1)));
    assert_eq!(done.run_until_idle().await.unwrap().len(), 4);
    // Enqueued last, taken first: the running job's row comes after every other one.
    let Enqueued::Added(waiting) = add(&db, bump_one(0)).await.unwrap() else {
        panic!("added");
    };
    let Enqueued::Added(held) = add(&db, bump_one(10)).await.unwrap() else {
        panic!("added");
    };
    let (started_tx, mut started) = tokio::sync::mpsc::channel::<()>(1);
    let (release_tx, release) = tokio::sync::watch::channel(false);
    let handlers = Jobs::new().handle(
        "bump",
        at_once(1),
        jobs::handler(move |tx, job: Job<Bump>| {
            let (started_tx, mut release) = (started_tx.clone(), release.clone());
            Box::pin(async move {
                if job.id == held {
                    started_tx.send(()).await.unwrap();
                    release.wait_for(|go| *go).await.unwrap();
                }
                bump(tx, job.payload.node).await?;
                Ok(())
            })
        }),
    );
    let running = Worker::new(Session::new(&handle), handlers.clone());
    let running = tokio::spawn(async move { running.run_one().await.unwrap() });
    started.recv().await.unwrap();
    // A bound, not a timing: the prune that waited for the running job's row waited for
    // `innodb_lock_wait_timeout` (50 s).
    let pruned = tokio::time::timeout(
        Duration::from_secs(20),
        jobs::prune(&handle, Duration::ZERO, jobs::Prune::Finished),
    )
    .await
    .expect("the prune does not wait for the running job")
    .unwrap();
    assert_eq!(pruned, 4);
    let other = Worker::new(Session::new(&handle), handlers);
    let run = other.run_one().await.unwrap().expect("the waiting job");
    assert_eq!((run.id, run.outcome), (waiting, JobOutcome::Completed));
    release_tx.send(true).unwrap();
    let run = running.await.unwrap().expect("the held job");
    assert_eq!((run.id, run.outcome), (held, JobOutcome::Completed));
    assert_eq!(total_score(&db).await, 6);
}

on_databases! {
    prune_beside_a_running_job_postgres: a_prune_beside_a_running_job_holds_nothing_up, postgres;
    prune_beside_a_running_job_mysql: a_prune_beside_a_running_job_holds_nothing_up, mysql;
}

/// A prune of more finished jobs than one batch deletes (1,000) deletes them all, batch by
/// batch.
#[tokio::test]
async fn a_prune_deletes_batch_after_batch() {
    let (_memory, db) = memory_with_node().await;
    let n = 2_345;
    let txn = db.begin().await.unwrap();
    for _ in 0..n {
        jobs::enqueue(&txn, NewJob::new("noop", &()).unwrap())
            .await
            .unwrap();
    }
    txn.commit().await.unwrap();
    let handlers = Jobs::new().handle(
        "noop",
        at_once(1),
        jobs::handler(|_tx, _job: Job<()>| Box::pin(async move { Ok(()) })),
    );
    let worker = Worker::new(Session::new(db.clone()), handlers).with_batch(100);
    assert_eq!(worker.run_until_idle().await.unwrap().len(), n);
    assert_eq!(
        jobs::prune(&db, Duration::ZERO, jobs::Prune::Finished)
            .await
            .unwrap(),
        n as u64
    );
    assert!(
        jobs::list(&db, jobs::JobState::Done, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

/// A job enqueued behind its key's running job, whose transaction commits only after that job
/// finished, is not lost behind the promotion that could not see it: a worker with nothing
/// else to do finds it and runs it.
async fn a_job_queued_behind_a_finished_one_still_runs(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let job = |seq| {
        NewJob::new("bump", &Bump { node: 1, seq })
            .unwrap()
            .key("ham:1")
    };
    add(&db, job(0)).await.unwrap();
    let late = db.begin().await.unwrap();
    let Enqueued::Added(second) = jobs::enqueue(&late, job(1)).await.unwrap() else {
        panic!("added");
    };
    let worker = Worker::new(Session::new(&handle), bump_jobs(at_once(1)));
    // SQLite has one writer: there the late enqueue commits first (nothing to strand).
    let sqlite = db.get_database_backend() == sea_orm::DbBackend::Sqlite;
    let mut late = Some(late);
    if sqlite {
        late.take().unwrap().commit().await.unwrap();
    }
    let first = worker.run_one().await.unwrap().expect("the first job");
    assert_eq!(first.outcome, JobOutcome::Completed);
    if let Some(late) = late {
        late.commit().await.unwrap();
    }
    let run = worker.run_one().await.unwrap().expect("the queued job");
    assert_eq!((run.id, run.outcome), (second, JobOutcome::Completed));
    assert_eq!(total_score(&db).await, 2);
}

on_databases! {
    queued_behind_a_finished_job_sqlite: a_job_queued_behind_a_finished_one_still_runs, sqlite;
    queued_behind_a_finished_job_postgres: a_job_queued_behind_a_finished_one_still_runs, postgres;
    queued_behind_a_finished_job_mysql: a_job_queued_behind_a_finished_one_still_runs, mysql;
}

// ------------------------------------------------------------------------------ wakeups

/// On PostgreSQL an enqueue wakes an idle worker at once (`LISTEN`/`NOTIFY`): a worker whose
/// poll waits an hour still runs a job enqueued while it waits. Behind a transaction pooler
/// (no `LISTEN` there) the worker polls every 20 ms and runs the jobs all the same.
async fn an_enqueue_wakes_an_idle_worker(db: Option<TestDb>) {
    let Some(db) = db else { return };
    let (db, handle) = (db.db, db.handle);
    // Behind a transaction pooler nothing wakes a worker (no `LISTEN` there): it polls, and
    // still runs the jobs.
    #[cfg(feature = "postgres")]
    let pooled = freshlock::transaction_pooler::is_adopted(&handle);
    #[cfg(not(feature = "postgres"))]
    let pooled = false;
    db.execute_unprepared("INSERT INTO node (id, title, changed) VALUES (1, 't', 0)")
        .await
        .unwrap();
    let (ran_tx, mut ran) = tokio::sync::mpsc::channel::<u32>(4);
    let handlers = Jobs::new().handle(
        "bump",
        at_once(1),
        jobs::handler(move |tx, job: Job<Bump>| {
            let ran_tx = ran_tx.clone();
            Box::pin(async move {
                bump(tx, job.payload.node).await?;
                ran_tx.send(job.payload.seq).await.unwrap();
                Ok(())
            })
        }),
    );
    let wait = if pooled {
        Duration::from_millis(20)
    } else {
        Duration::from_secs(3600)
    };
    let worker = Worker::new(Session::new(&handle), handlers).with_poll(wait, wait);
    let (stop_tx, running) = run_in_background(worker);
    for seq in 0..2 {
        // Time for the worker to find nothing and settle into its hour-long wait. (Were the
        // job enqueued earlier, its take would find it: the test would pass without a wakeup,
        // never fail with one.)
        tokio::time::sleep(Duration::from_millis(300)).await;
        add(&db, NewJob::new("bump", &Bump { node: 1, seq }).unwrap())
            .await
            .unwrap();
        let woke = tokio::time::timeout(Duration::from_secs(30), ran.recv()).await;
        assert_eq!(woke.expect("woken by the enqueue"), Some(seq));
    }
    stop_tx.send(()).unwrap();
    assert_eq!(running.await.unwrap(), 2);
    assert_eq!(total_score(&db).await, 2);
}

on_databases! {
    an_enqueue_wakes_an_idle_worker_postgres: an_enqueue_wakes_an_idle_worker, postgres;
}

// ----------------------------------------------------------------------------- deadlocks

/// Two jobs that lock two rows in opposite orders deadlock; the database ends one of the
/// transactions (MySQL/MariaDB end it whole, savepoint included). The victim's attempt runs
/// again and both jobs complete, each effect once: a deadlock is never a worker's error.
async fn a_deadlocked_handler_runs_again(db: Option<TestDb>) {
    deadlocked_handlers(db, false).await;
}

/// The same when the deadlock reaches the handler through its `Tx`'s repository (a
/// `freshlock::Error`, not a `DbErr`): the attempt runs again, not counted as a failure of the
/// job (it was taken for the handler's own failure, and in a savepoint on MySQL/MariaDB it
/// failed the worker).
async fn a_deadlock_through_a_repository_runs_again(db: Option<TestDb>) {
    deadlocked_handlers(db, true).await;
}

async fn deadlocked_handlers(db: Option<TestDb>, through_repository: bool) {
    let Some(db) = db else { return };
    db.seed_nodes(2).await;
    let (db, handle) = (db.db, db.handle);
    for (seq, first) in [(0, 1), (1, 2)] {
        add(
            &db,
            NewJob::new("cross", &Bump { node: first, seq }).unwrap(),
        )
        .await
        .unwrap();
    }
    // Both handlers hold their first row before either asks for its second (first attempts).
    let both = Arc::new(tokio::sync::Barrier::new(2));
    let first_attempts = Arc::new(AtomicUsize::new(0));
    let handlers = Jobs::new().handle(
        "cross",
        at_once(3),
        jobs::handler(move |tx, job: Job<Bump>| {
            let (both, first_attempts) = (Arc::clone(&both), Arc::clone(&first_attempts));
            Box::pin(async move {
                let first = job.payload.node;
                bump(tx, first).await?;
                if first_attempts.fetch_add(1, Ordering::SeqCst) < 2 {
                    both.wait().await;
                }
                if !through_repository {
                    bump(tx, 3 - first).await?;
                    return Ok(());
                }
                let nodes = tx.repository::<entity::node::Entity>();
                let found = nodes.load_locked(3 - first, ForUpdate::Wait).await?;
                let found = found.ok_or_else(|| ApplyError::msg("no such node"))?;
                let mut model = (*found).clone().into_active_model();
                model.score = Set(Some(found.score.unwrap_or(0) + 1));
                nodes.save(model).await?;
                Ok(())
            })
        }),
    );
    let session = Session::new(&handle);
    let one = Worker::new(session.clone(), handlers.clone());
    let two = Worker::new(session, handlers);
    let (a, b) = tokio::join!(one.run_until_idle(), two.run_until_idle());
    let runs: Vec<_> = (a.expect("no worker error"))
        .into_iter()
        .chain(b.expect("no worker error"))
        .collect();
    let completed = runs
        .iter()
        .filter(|r| r.outcome == JobOutcome::Completed)
        .count();
    assert_eq!(completed, 2, "{runs:?}");
    assert_eq!(runs.len(), 2, "no attempt counted as failed: {runs:?}");
    assert_eq!(
        total_score(&db).await,
        4,
        "two rows bumped by each job, once"
    );
    assert_eq!(jobs_in(&db, 2).await, 2);
}

on_databases! {
    a_deadlocked_handler_runs_again_postgres: a_deadlocked_handler_runs_again, postgres;
    a_deadlocked_handler_runs_again_mysql: a_deadlocked_handler_runs_again, mysql;
    deadlock_via_repository_postgres: a_deadlock_through_a_repository_runs_again, postgres;
    deadlock_via_repository_mysql: a_deadlock_through_a_repository_runs_again, mysql;
}

// ------------------------------------------------------------------------ key following

/// A worker that finished a key's job and readied the key's next takes that one first, so a
/// hot key's chain never waits for a free worker: enqueued a1, b1, a2, one worker runs a1, a2,
/// b1 (by id alone it would run a1, b1, a2). `run_batch` alone does not follow.
#[tokio::test]
async fn a_worker_follows_the_key_whose_next_job_it_readied() {
    let (_test, db) = memory_with_node().await;
    let enqueue_three = || async {
        for (seq, key) in [(0, "a"), (1, "b"), (2, "a")] {
            add(
                &db,
                NewJob::new("bump", &Bump { node: 1, seq })
                    .unwrap()
                    .key(key),
            )
            .await
            .unwrap();
        }
    };
    let worker = Worker::new(Session::new(db.clone()), bump_jobs(at_once(1)));
    enqueue_three().await;
    let ids: Vec<_> = (worker.run_until_idle().await.unwrap())
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids, [1, 3, 2], "a1, then a2 (followed), then b1");
    enqueue_three().await;
    let mut by_batch = Vec::new();
    while let Some(run) = worker.run_one().await.unwrap() {
        by_batch.push(run.id);
    }
    assert_eq!(by_batch, [4, 5, 6], "by id");
}

// ----------------------------------------------------------------------- chained keys

/// A worker following a key runs the key's next jobs in the same transaction (a chain of up to
/// 16 short jobs, within 100 ms): 20 jobs of one key commit in two transactions, not twenty —
/// each job's write still once, in order. `run_one` never chains. The transaction is the one the
/// database names (`txid_current()`; on MariaDB the connection and its count of commits), read
/// by each handler.
async fn a_hot_keys_short_jobs_share_a_transaction(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let seen: Arc<std::sync::Mutex<Vec<(u32, i64)>>> = Arc::default();
    let handlers =
        {
            let seen = Arc::clone(&seen);
            Jobs::new().handle("txid", at_once(1), jobs::handler(move |tx, job: Job<Bump>| {
            let seen = Arc::clone(&seen);
            Box::pin(async move {
                bump(tx, job.payload.node).await?;
                let sql = if tx.get_database_backend() == sea_orm::DbBackend::Postgres {
                    "SELECT CAST(txid_current() AS BIGINT) AS txid"
                } else {
                    // The connection and its commits so far (`innodb_trx` is a cache
                    // refreshed every 100 ms: a new transaction may not be in it yet).
                    "SELECT CAST(CONNECTION_ID() * 1000000 + VARIABLE_VALUE AS SIGNED) AS txid \
                     FROM information_schema.SESSION_STATUS WHERE VARIABLE_NAME = 'COM_COMMIT'"
                };
                let row = tx
                    .query_one_raw(Statement::from_string(tx.get_database_backend(), sql))
                    .await?
                    .ok_or_else(|| freshlock::ApplyError::msg("no row"))?;
                let txid: i64 = row.try_get("", "txid")?;
                seen.lock().unwrap().push((job.payload.seq, txid));
                Ok(())
            })
        }))
        };
    let enqueue = |n: u32| {
        let db = db.clone();
        async move {
            for seq in 0..n {
                let job = NewJob::new("txid", &Bump { node: 1, seq })
                    .unwrap()
                    .key("hot");
                add(&db, job).await.unwrap();
            }
        }
    };
    let worker = Worker::new(Session::new(&handle), handlers);
    enqueue(20).await;
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 20);
    let chained = std::mem::take(&mut *seen.lock().unwrap());
    let order: Vec<u32> = chained.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(order, (0..20).collect::<Vec<_>>(), "in enqueue order");
    // Transactions and their jobs, in order: at most 16 each, and (unless a job took most of
    // the chain's 100 ms) 16 then 4.
    let mut sizes: Vec<(i64, usize)> = Vec::new();
    for (_, txid) in &chained {
        match sizes.last_mut() {
            Some((last, n)) if last == txid => *n += 1,
            _ => sizes.push((*txid, 1)),
        }
    }
    assert!(sizes.iter().all(|(_, n)| *n <= 16), "{sizes:?}");
    assert!(
        sizes.len() < 20,
        "the hot key's jobs shared transactions: {sizes:?}"
    );
    enqueue(3).await;
    while worker.run_one().await.unwrap().is_some() {}
    let mut one_by_one: Vec<i64> = seen.lock().unwrap().iter().map(|(_, t)| *t).collect();
    one_by_one.dedup();
    assert_eq!(one_by_one.len(), 3, "run_one: a transaction per job");
    assert_eq!(total_score(&db).await, 23, "each job's write once");
    assert_eq!(jobs_in(&db, 2).await, 23);
}

on_databases! {
    hot_key_jobs_chain_postgres: a_hot_keys_short_jobs_share_a_transaction, postgres;
    hot_key_jobs_chain_mysql: a_hot_keys_short_jobs_share_a_transaction, mysql;
}

/// Jobs of kind `ordered` bump node 1 and check that they run in their key's order: job `seq`
/// finds the node at `seq` (what the jobs before it committed, or wrote earlier in its own
/// transaction — a chain's). Job `fail` fails, under `policy`. Returns the handlers and the
/// seqs that found the node at another value.
fn ordered_jobs(fail: u32, policy: RetryPolicy) -> (Jobs, Arc<std::sync::Mutex<Vec<u32>>>) {
    let misordered: Arc<std::sync::Mutex<Vec<u32>>> = Arc::default();
    let handlers = {
        let misordered = Arc::clone(&misordered);
        Jobs::new().handle(
            "ordered",
            policy,
            jobs::handler(move |tx, job: Job<Bump>| {
                let misordered = Arc::clone(&misordered);
                Box::pin(async move {
                    let sql = "SELECT score FROM node WHERE id = 1";
                    let row = tx
                        .query_one_raw(Statement::from_string(tx.get_database_backend(), sql))
                        .await?
                        .ok_or_else(|| freshlock::ApplyError::msg("no node"))?;
                    let score: Option<i32> = row.try_get("", "score")?;
                    if job.payload.seq == fail {
                        return Err(freshlock::ApplyError::msg("this one fails"));
                    }
                    if score.unwrap_or(0) != i32::try_from(job.payload.seq).unwrap() {
                        misordered.lock().unwrap().push(job.payload.seq);
                    }
                    bump(tx, job.payload.node).await?;
                    Ok(())
                })
            }),
        )
    };
    (handlers, misordered)
}

async fn enqueue_ordered(db: &DatabaseConnection, n: u32) {
    for seq in 0..n {
        let job = NewJob::new("ordered", &Bump { node: 1, seq }).unwrap();
        add(db, job.key("hot")).await.unwrap();
    }
}

/// The states of the jobs, by id.
async fn states(db: &DatabaseConnection) -> Vec<i64> {
    let sql = format!(
        "SELECT {} AS n FROM freshlock_job ORDER BY id",
        bigint(db, "state")
    );
    // In a transaction of its own, as `number`: behind a transaction pooler a prepared
    // statement lives on the server connection of its transaction only.
    let txn = db.begin().await.unwrap();
    let rows = txn
        .query_all_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .unwrap();
    txn.commit().await.unwrap();
    rows.iter().map(|r| r.try_get("", "n").unwrap()).collect()
}

/// A chain (a hot key's jobs run one after another in one transaction, locked together) ends
/// at a job that fails and waits for its retry: the jobs behind it neither run nor become
/// ready — they stay queued behind it, the retry first in line — and what ran before it
/// commits once.
async fn a_chain_stops_at_a_retry_and_its_key_waits_for_it(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let hour = Duration::from_secs(3600);
    let later = RetryPolicy::default()
        .with_max_attempts(2)
        .with_backoff(hour, hour);
    let (handlers, misordered) = ordered_jobs(2, later);
    enqueue_ordered(&db, 6).await;
    let worker = Worker::new(Session::new(&handle), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    let outcomes: Vec<_> = runs.iter().map(|r| (r.id, r.outcome.clone())).collect();
    assert_eq!(outcomes.len(), 3, "{outcomes:?}");
    assert!(matches!(outcomes[2].1, JobOutcome::Retrying { .. }));
    let (done, pending, queued) = (2, 0, 5);
    assert_eq!(
        states(&db).await,
        [done, done, pending, queued, queued, queued],
        "the retry waits first in line, its followers queued behind it"
    );
    assert_eq!(total_score(&db).await, 2, "the two before it, once");
    assert!(misordered.lock().unwrap().is_empty());
}

on_databases! {
    a_chain_stops_at_a_retry_sqlite: a_chain_stops_at_a_retry_and_its_key_waits_for_it, sqlite;
    a_chain_stops_at_a_retry_postgres: a_chain_stops_at_a_retry_and_its_key_waits_for_it, postgres;
    a_chain_stops_at_a_retry_mysql: a_chain_stops_at_a_retry_and_its_key_waits_for_it, mysql;
}

/// A chain runs only its key's unbroken line of due jobs of the worker's kinds: it stops before
/// a job of its key that is not due yet, or of a kind the worker does not take, and the jobs
/// behind that one wait for it (they are locked by the chain's scan, but not run).
async fn a_chain_stops_where_its_keys_line_breaks(db: Option<TestDb>) {
    let Some(db) = db else { return };
    let (db, handle) = (db.db, db.handle);
    let ran: Arc<Mutex<Vec<i64>>> = Arc::default();
    let handlers = {
        let ran = Arc::clone(&ran);
        Jobs::new().handle(
            "step",
            at_once(1),
            jobs::handler(move |_tx, job: Job<()>| {
                let ran = Arc::clone(&ran);
                Box::pin(async move {
                    ran.lock().unwrap().push(job.id);
                    Ok(())
                })
            }),
        )
    };
    let hour = Duration::from_secs(3600);
    let line = [
        // Key a: 1 and 2 run; 3 is not due; 4 waits behind it.
        (NewJob::new("step", &()).unwrap().key("a"), 1),
        (NewJob::new("step", &()).unwrap().key("a"), 2),
        (NewJob::new("step", &()).unwrap().key("a").delay(hour), 3),
        (NewJob::new("step", &()).unwrap().key("a"), 4),
        // Key b: 5 runs; nobody here takes 6; 7 waits behind it.
        (NewJob::new("step", &()).unwrap().key("b"), 5),
        (NewJob::new("elsewhere", &()).unwrap().key("b"), 6),
        (NewJob::new("step", &()).unwrap().key("b"), 7),
    ];
    for (job, id) in line {
        assert_eq!(add(&db, job).await.unwrap(), Enqueued::Added(id));
    }
    let worker = Worker::new(Session::new(&handle), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    let mut ran = ran.lock().unwrap().clone();
    ran.sort_unstable();
    assert_eq!(ran, [1, 2, 5], "{runs:?}");
    let (done, pending, queued) = (2, 0, 5);
    assert_eq!(
        states(&db).await,
        [done, done, pending, queued, done, pending, queued],
        "each key's first unfinished job is ready (3 not due, 6 for another worker), the rest queued"
    );
}

on_databases! {
    line_breaks_sqlite: a_chain_stops_where_its_keys_line_breaks, sqlite;
    line_breaks_postgres: a_chain_stops_where_its_keys_line_breaks, postgres;
    line_breaks_mysql: a_chain_stops_where_its_keys_line_breaks, mysql;
}

/// A job whose enqueue commits after its key's head finished is stranded — queued, but the head's
/// promotion could not see it — until a worker's sweep readies it; then it runs, once. (Not on
/// SQLite: the open enqueue would hold its only writer.)
async fn a_stranded_job_is_swept_and_runs(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let handlers = Jobs::new().handle("bump", at_once(1), job_support::bump_node);
    let job = || NewJob::new("bump", &1_i32).unwrap().key("k");
    assert_eq!(add(&db, job()).await.unwrap(), Enqueued::Added(1));
    let late = db.begin().await.unwrap();
    assert_eq!(
        jobs::enqueue(&late, job()).await.unwrap(),
        Enqueued::Added(2)
    );
    let first = Worker::new(Session::new(&handle), handlers.clone());
    let runs = first.run_until_idle().await.unwrap();
    assert_eq!(runs.iter().map(|r| r.id).collect::<Vec<_>>(), [1]);
    late.commit().await.unwrap();
    let (done, queued) = (2, 5);
    assert_eq!(states(&db).await, [done, queued], "job 2 is stranded");
    // A worker of its own: its first empty take sweeps (at most once a second per worker).
    let second = Worker::new(Session::new(&handle), handlers);
    let runs = second.run_until_idle().await.unwrap();
    assert_eq!(runs.iter().map(|r| r.id).collect::<Vec<_>>(), [2]);
    assert_eq!(states(&db).await, [done, done]);
    assert_eq!(total_score(&db).await, 2);
}

on_databases! {
    stranded_is_swept_postgres: a_stranded_job_is_swept_and_runs, postgres;
    stranded_is_swept_mysql: a_stranded_job_is_swept_and_runs, mysql;
}

/// A job of a hot key that fails for good ends its chain; the key's next job is readied past
/// the jobs the chain completed, and the rest run in order, each effect once.
async fn a_key_goes_on_past_a_job_that_failed_for_good(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    // Job 4 (seq 99) fails for good, between seqs 2 and 3.
    let (handlers, misordered) = ordered_jobs(99, at_once(1));
    enqueue_ordered(&db, 3).await;
    let job = NewJob::new("ordered", &Bump { node: 1, seq: 99 }).unwrap();
    add(&db, job.key("hot")).await.unwrap();
    for seq in 3..20 {
        let job = NewJob::new("ordered", &Bump { node: 1, seq }).unwrap();
        add(&db, job.key("hot")).await.unwrap();
    }
    let worker = Worker::new(Session::new(&handle), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    let failed: Vec<_> = (runs.iter())
        .filter(|r| matches!(r.outcome, JobOutcome::Failed(_)))
        .map(|r| r.id)
        .collect();
    assert_eq!(failed, [4], "{runs:?}");
    let ids: Vec<_> = runs.iter().map(|r| r.id).collect();
    assert_eq!(ids, (1..=21).collect::<Vec<_>>(), "in enqueue order");
    assert!(misordered.lock().unwrap().is_empty());
    assert_eq!(total_score(&db).await, 20);
    assert_eq!(jobs_in(&db, 2).await, 20);
    assert_eq!(jobs_in(&db, 3).await, 1);
}

/// A job of a leased kind in a hot key's line ends the chain before it: it is claimed by a take
/// of its own, works outside the transaction, and the in-transaction jobs behind it run only
/// after its finish committed.
async fn a_leased_job_in_a_hot_keys_line_ends_the_chain(db: Option<TestDb>) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let (db, handle) = (db.db, db.handle);
    let (handlers, misordered) = ordered_jobs(u32::MAX, at_once(1));
    let handlers = handlers.handle_leased(
        "leased",
        at_once(1),
        Duration::from_secs(30),
        |job: Job<Bump>, _lease: jobs::Lease| async move {
            Ok::<_, freshlock::ApplyError>(job.payload.node)
        },
        job_support::bump_output,
    );
    for (seq, kind) in [
        (0, "ordered"),
        (1, "ordered"),
        (2, "leased"),
        (3, "ordered"),
    ] {
        let job = NewJob::new(kind, &Bump { node: 1, seq }).unwrap();
        add(&db, job.key("hot")).await.unwrap();
    }
    let worker = Worker::new(Session::new(&handle), handlers);
    let runs = worker.run_until_idle().await.unwrap();
    let ids: Vec<_> = runs.iter().map(|r| (r.id, r.outcome.clone())).collect();
    let completed = JobOutcome::Completed;
    assert_eq!(
        ids,
        [
            (1, completed.clone()),
            (2, completed.clone()),
            (3, completed.clone()),
            (4, completed)
        ]
    );
    assert!(misordered.lock().unwrap().is_empty(), "{misordered:?}");
    assert_eq!(total_score(&db).await, 4);
    assert_eq!(jobs_in(&db, 2).await, 4);
}

on_databases! {
    leased_in_a_chain_sqlite: a_leased_job_in_a_hot_keys_line_ends_the_chain, sqlite;
    leased_in_a_chain_postgres: a_leased_job_in_a_hot_keys_line_ends_the_chain, postgres;
    leased_in_a_chain_mysql: a_leased_job_in_a_hot_keys_line_ends_the_chain, mysql;
}

on_databases! {
    past_a_failed_job_sqlite: a_key_goes_on_past_a_job_that_failed_for_good, sqlite;
    past_a_failed_job_postgres: a_key_goes_on_past_a_job_that_failed_for_good, postgres;
    past_a_failed_job_mysql: a_key_goes_on_past_a_job_that_failed_for_good, mysql;
}
