//! The service over real HTTP on a loopback port: concurrent requests updating different fields
//! of the same rows, with and without request timeouts.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use entity::node;
use freshlock::lock::LocalLock;
use freshlock::{LockPolicy, testing::TestDatabase};
use freshlock_axum_example::{AppState, app, check, request};
use migration::Migrator;
use sea_orm::EntityTrait;

const NODES: i32 = 20;

async fn database() -> TestDatabase {
    let db = TestDatabase::with_migrator::<Migrator>().await.unwrap();
    let rows = (1..=NODES).map(node::ActiveModel::fresh);
    node::Entity::insert_many(rows)
        .exec(db.connection())
        .await
        .unwrap();
    db
}

/// Serves the app on a free loopback port; the server stops with the test's runtime.
async fn serve(db: &TestDatabase, lock: &LocalLock, timeout: Duration) -> SocketAddr {
    let state = AppState {
        db: freshlock::Db::new(db.connection().clone()),
        lock: Arc::new(lock.clone()),
        policy: LockPolicy::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app(state, timeout)).await });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_for_different_fields_of_the_same_rows_lose_nothing() {
    let db = database().await;
    let addr = serve(&db, &LocalLock::new(), Duration::from_secs(30)).await;
    for round in 1..=3 {
        let report = check(addr, "", NODES, round, 20).await.unwrap();
        assert!(report.passed(), "{report:#?}");
        assert_eq!((report.sent, report.ok), (80, 80), "{report:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_catches_the_naive_handler_losing_writes() {
    let db = database().await;
    let addr = serve(&db, &LocalLock::new(), Duration::from_secs(30)).await;
    let report = check(addr, "/naive", NODES, 1, 20).await.unwrap();
    assert_eq!(report.ok, 80, "every naive write was acknowledged…");
    assert!(!report.lost.is_empty(), "…and some were lost: {report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeouts_never_half_write_and_leave_no_lock_behind() {
    let db = database().await;
    let lock = LocalLock::new();
    // A 4 ms budget against 0–8 ms of work: many requests time out, some in the middle of
    // their locked update.
    let hurried = serve(&db, &lock, Duration::from_millis(4)).await;
    let mut timed_out = 0;
    for round in 1..=3 {
        let report = check(hurried, "", NODES, round, 8).await.unwrap();
        assert!(report.passed(), "{report:#?}");
        timed_out += report.timed_out;
    }
    assert!(timed_out > 0, "the budget is short enough to cut requests");

    // Cancelled sections finish on their own (commit or roll back, then release).
    tokio::time::timeout(Duration::from_secs(10), async {
        while !lock.is_empty() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("every lock is released");

    // The same rows, with time to spare: everything goes through at once.
    let patient = serve(&db, &lock, Duration::from_secs(30)).await;
    let report = check(patient, "", NODES, 4, 2).await.unwrap();
    assert!(report.passed(), "{report:#?}");
    assert_eq!(report.ok, 80);
    let (status, _) = request(patient, "PUT", "/nodes/1/score", "not a number")
        .await
        .unwrap();
    assert_eq!(status, 400, "bad input is refused before any lock or write");
}
