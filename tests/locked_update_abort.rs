//! When `apply` fails, panics, or the caller goes away: rolled back, nothing cached, lock free.

mod common;

use std::{
    panic::AssertUnwindSafe,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use common::{memory_db, must_lock_now, node_in_db, seed_nodes};
use entity::node;
use freshlock::lock::backend::LeaseLock;
use freshlock::lock::{LocalLock, LockName};
use freshlock::{ApplyError, Error, Session, UpdateOutcome};
use futures::FutureExt;
use sea_orm::{ConnectionTrait, Set, TransactionTrait};

fn sessions(db: &sea_orm::DatabaseConnection, lock: &LocalLock) -> (Session, Session) {
    let worker = common::session(db, lock);
    let prober = Session::builder(db.clone())
        .lock(Arc::new(lock.clone()))
        .policy(must_lock_now())
        .build()
        .unwrap();
    (worker, prober)
}

/// Proves the lock of node `id` is free and the database still works: a follow-up that must
/// take the lock at once succeeds and writes.
async fn assert_lock_free_and_row_writable(prober: &Session, id: i32) {
    let report = prober
        .repository::<node::Entity>()
        .locked_update(id, |n| {
            n.analysis = Set(Some("probe".into()));
            Ok(())
        })
        .await
        .expect("the lock is free and the database alive");
    assert!(report.lock.held);
    assert!(report.outcome.is_updated());
}

#[tokio::test]
async fn apply_error_rolls_back_and_frees_the_lock() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let lock = LocalLock::new();
    let (worker, prober) = sessions(&db, &lock);
    let nodes = worker.repository::<node::Entity>();
    nodes.load(1).await.unwrap();

    let result = nodes
        .locked_update(1, |n| {
            n.score = Set(Some(13));
            Err(ApplyError::msg("score is unlucky"))
        })
        .await;
    match result {
        Err(Error::Apply { target, source }) => {
            assert_eq!(target, "node:1");
            assert_eq!(source.to_string(), "score is unlucky");
        }
        other => panic!("expected Error::Apply, got {other:?}"),
    }
    assert_eq!(node_in_db(&db, 1).await.score, None, "nothing written");
    assert_eq!(worker.cache_stats().len, 0, "no half-applied row cached");
    assert!(lock.is_empty());
    assert_lock_free_and_row_writable(&prober, 1).await;
}

#[tokio::test]
async fn apply_error_of_any_type_converts_with_question_mark() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let session = common::session(&db, &LocalLock::new());
    let result = session
        .repository::<node::Entity>()
        .locked_update(1, |n| {
            let parsed: i32 = "not a number".parse()?;
            n.score = Set(Some(parsed));
            Ok(())
        })
        .await;
    let Err(Error::Apply { source, .. }) = result else {
        panic!("expected Error::Apply");
    };
    assert!(source.downcast_ref::<std::num::ParseIntError>().is_some());
}

#[tokio::test]
async fn apply_panic_rolls_back_frees_the_lock_and_reaches_the_caller() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let lock = LocalLock::new();
    let (worker, prober) = sessions(&db, &lock);
    let nodes = worker.repository::<node::Entity>();

    let outcome = AssertUnwindSafe(nodes.locked_update(1, |n| {
        n.score = Set(Some(13));
        panic!("apply exploded");
    }))
    .catch_unwind()
    .await;
    let panic = outcome.expect_err("the panic reaches the caller");
    assert_eq!(panic.downcast_ref::<&str>(), Some(&"apply exploded"));

    assert_eq!(node_in_db(&db, 1).await.score, None);
    assert_eq!(worker.cache_stats().len, 0);
    assert!(lock.is_empty());
    assert_lock_free_and_row_writable(&prober, 1).await;
}

#[tokio::test]
async fn changing_the_primary_key_is_refused() {
    let db = memory_db().await;
    seed_nodes(&db, 2).await;
    let lock = LocalLock::new();
    let (worker, prober) = sessions(&db, &lock);
    let result = worker
        .repository::<node::Entity>()
        .locked_update(1, |n| {
            n.id = Set(2);
            n.score = Set(Some(1));
            Ok(())
        })
        .await;
    assert!(matches!(result, Err(Error::PrimaryKeyChanged { .. })));
    assert_eq!(node_in_db(&db, 2).await.score, None);
    assert_lock_free_and_row_writable(&prober, 1).await;
}

#[tokio::test]
async fn missing_row_is_an_outcome() {
    let db = memory_db().await;
    let session = common::session(&db, &LocalLock::new());
    let calls = AtomicU32::new(0);
    let report = session
        .repository::<node::Entity>()
        .locked_update(404, |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .await
        .unwrap();
    assert!(matches!(report.outcome, UpdateOutcome::NotFound));
    assert_eq!(
        calls.load(Ordering::Relaxed),
        0,
        "apply is not run without a row"
    );
}

#[tokio::test]
async fn caller_dropped_while_waiting_for_the_lock_writes_nothing_and_leaves_no_lock() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let lock = LocalLock::new();
    let (worker, prober) = sessions(&db, &lock);
    let name = LockName::new("node:1").unwrap();
    let held = lock
        .acquire(&name, Duration::ZERO, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();

    let nodes = worker.repository::<node::Entity>();
    let call = tokio::spawn(async move {
        nodes
            .locked_update(1, |n| {
                n.score = Set(Some(1));
                Ok(())
            })
            .await
    });
    // Wait until the driver queues on the lock, then cancel the caller.
    common::eventually(
        "the driver queues on the lock",
        Duration::from_secs(10),
        || lock.queue_len(&name) >= 2,
    )
    .await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    held.release().await.unwrap();

    wait_until_free(&lock).await;
    assert_eq!(node_in_db(&db, 1).await.score, None);
    assert_lock_free_and_row_writable(&prober, 1).await;
}

#[tokio::test]
async fn caller_dropped_inside_the_transaction_rolls_back_and_keeps_the_database_alive() {
    let db = memory_db().await; // one pooled connection: the in-memory database dies with it
    seed_nodes(&db, 1).await;
    let lock = LocalLock::new();
    let (worker, prober) = sessions(&db, &lock);

    // Hold the only connection so the locked section stops right after taking the lock.
    let blocker = db.begin().await.unwrap();
    let applied = Arc::new(AtomicU32::new(0));
    let nodes = worker.repository::<node::Entity>();
    let seen = Arc::clone(&applied);
    let call = tokio::spawn(async move {
        nodes
            .locked_update(1, |n| {
                seen.fetch_add(1, Ordering::Relaxed);
                n.score = Set(Some(1));
                Ok(())
            })
            .await
    });
    common::eventually(
        "the section takes the lock",
        Duration::from_secs(10),
        || !lock.is_empty(),
    )
    .await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    blocker
        .execute_unprepared("SELECT 1")
        .await
        .expect("the blocker's connection is fine");
    blocker.commit().await.unwrap();

    wait_until_free(&lock).await;
    assert_eq!(applied.load(Ordering::Relaxed), 0, "apply never ran");
    assert_eq!(node_in_db(&db, 1).await.score, None);
    assert_lock_free_and_row_writable(&prober, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_timeouts_never_break_the_database_the_lock_or_the_cache() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let lock = LocalLock::new();
    let (worker, prober) = sessions(&db, &lock);
    let nodes = worker.repository::<node::Entity>();
    let (mut succeeded, mut cut) = (0, 0);
    let applied = AtomicU32::new(0);
    for i in 0..300u64 {
        // A request timeout cutting the call anywhere: before, during or after the section.
        let budget = Duration::from_micros((i * 7919) % 400);
        let call = nodes.locked_update(1, |n| {
            applied.fetch_add(1, Ordering::Relaxed);
            let current = n.score.as_ref().unwrap_or(0);
            n.score = Set(Some(current + 1));
            Ok(())
        });
        let finished = if i % 5 == 0 {
            // Every fifth call is dropped after its first poll: a cut that does not depend on
            // the timer (whose 1 ms tick can outlast a whole call on a fast machine).
            let mut call = std::pin::pin!(call);
            match futures::poll!(call.as_mut()) {
                std::task::Poll::Ready(result) => Some(result),
                std::task::Poll::Pending => None,
            }
        } else {
            tokio::time::timeout(budget, call).await.ok()
        };
        match finished {
            Some(result) => {
                assert!(result.unwrap().outcome.is_updated());
                succeeded += 1;
            }
            None => cut += 1,
        }
    }
    wait_until_free(&lock).await;
    // Calls were cut (every fifth at its first poll, others by their timeout), and some finished.
    assert!(cut > 0 && succeeded < 300, "no call was cut");
    assert!(succeeded > 0, "no call finished within its budget");
    let score = node_in_db(&db, 1).await.score.unwrap_or(0) as u32;
    assert!(
        score >= succeeded,
        "a reported update is missing: {score} < {succeeded}"
    );
    assert!(score <= applied.load(Ordering::Relaxed));
    // The cache never holds a row that was not committed: a load agrees with the database.
    if let Some(cached) = nodes.load(1).await.unwrap() {
        assert!(cached.score.unwrap_or(0) as u32 <= score);
    }
    nodes.reset_cache([1]).unwrap();
    assert_eq!(
        nodes.load(1).await.unwrap().unwrap().score.unwrap_or(0) as u32,
        score
    );
    assert_lock_free_and_row_writable(&prober, 1).await;
}

/// Waits (by yielding, not sleeping) until abandoned locked sections have finished.
async fn wait_until_free(lock: &LocalLock) {
    common::eventually("abandoned sections finish", Duration::from_secs(30), || {
        lock.is_empty()
    })
    .await;
}
