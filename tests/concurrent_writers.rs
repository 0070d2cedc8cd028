//! Many tasks writing the same rows through `locked_update`: nothing is lost.

mod common;

use std::sync::Arc;

use common::{memory_db, seed_nodes, session};
use entity::node;
use freshlock::lock::LocalLock;
use sea_orm::{EntityTrait, Set};
use tokio::sync::Barrier;
use workload::drupal;

const NODES: i32 = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_field_writers_over_100_nodes_lose_no_field() {
    let db = memory_db().await;
    seed_nodes(&db, NODES).await;
    let lock = LocalLock::new();
    let start = Arc::new(Barrier::new(4));

    let workers = drupal::Field::ALL.map(|field| {
        // Each worker is its own job with its own session (and cache).
        let session = session(&db, &lock);
        let start = Arc::clone(&start);
        tokio::spawn(async move {
            let nodes = session.repository::<node::Entity>();
            start.wait().await;
            for id in 1..=NODES {
                // The seed's shape: load (cached) → heavy work → write through the lock.
                nodes.load(id).await.unwrap().unwrap();
                tokio::task::yield_now().await; // the "heavy work": let the others run
                let report = nodes
                    .locked_update(id, |n| {
                        field.set(n, id);
                        Ok(())
                    })
                    .await
                    .unwrap();
                assert!(report.outcome.is_updated());
                assert!(report.lock.held);
            }
        })
    });
    for worker in workers {
        worker.await.unwrap();
    }

    let rows = node::Entity::find().all(&db).await.unwrap();
    assert_eq!(rows.len(), NODES as usize);
    assert_eq!(drupal::lost_fields(&db).await.unwrap(), 0, "fields lost");
    assert!(lock.is_empty(), "no lock entry left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_tasks_times_fifty_increments_make_exactly_400() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let lock = LocalLock::new();
    let start = Arc::new(Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let session = session(&db, &lock);
            let start = Arc::clone(&start);
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                start.wait().await;
                for _ in 0..50 {
                    nodes
                        .locked_update(1, |n| {
                            let current = n.score.as_ref().unwrap_or(0);
                            n.score = Set(Some(current + 1));
                            Ok(())
                        })
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let row = common::node_in_db(&db, 1).await;
    assert_eq!(row.score, Some(400));
}

/// The shared Drupal workload as the demo and the benchmarks drive it: four field workers per
/// node, each with its own session, through the strategies that must lose nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drupal_workload_loses_nothing_through_freshlock_or_a_lock_around_the_work() {
    for strategy in [
        drupal::Strategy::Freshlock,
        drupal::Strategy::LockAroundWork,
    ] {
        let db = memory_db().await;
        drupal::seed(&db, 20).await.unwrap();
        let lock = LocalLock::new();
        let start = Arc::new(Barrier::new(4));
        let workers = drupal::Field::ALL.map(|field| {
            let (session, lock, start) = (session(&db, &lock), lock.clone(), Arc::clone(&start));
            tokio::spawn(async move {
                start.wait().await;
                for id in 1..=20 {
                    let work = std::time::Duration::from_millis(1);
                    drupal::job(strategy, &session, &lock, id, field, work)
                        .await
                        .unwrap();
                }
            })
        });
        for worker in workers {
            worker.await.unwrap();
        }
        assert_eq!(drupal::lost_fields(&db).await.unwrap(), 0, "{strategy:?}");
        assert!(lock.is_empty(), "{strategy:?}: no lock entry left behind");
    }
}
