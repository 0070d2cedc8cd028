//! The in-process lock keeps no entry for keys nobody holds or waits for.

mod common;

use std::{sync::Arc, time::Duration};

use common::{memory_db, seed_nodes};
use entity::node;
use freshlock::Session;
use freshlock::lock::backend::LeaseLock;
use freshlock::lock::{LocalLock, LockName};
use sea_orm::Set;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_distinct_keys_locked_and_released_leave_no_entry() {
    let lock = LocalLock::new();
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let lock = lock.clone();
            tokio::spawn(async move {
                for i in 0..2_500 {
                    let name = LockName::new(format!("key:{t}:{i}")).unwrap();
                    let guard = lock
                        .acquire(&name, Duration::from_secs(1), Duration::from_secs(60))
                        .await
                        .unwrap()
                        .expect("uncontended");
                    assert_eq!(lock.queue_len(&name), 1);
                    guard.release().await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(lock.len(), 0);
}

#[tokio::test]
async fn locked_updates_of_many_rows_leave_no_entry() {
    let db = memory_db().await;
    seed_nodes(&db, 300).await;
    let lock = LocalLock::new();
    let session = Session::builder(db.clone())
        .lock(Arc::new(lock.clone()))
        .build()
        .unwrap();
    let nodes = session.repository::<node::Entity>();
    for id in 1..=300 {
        nodes
            .locked_update(id, |n| {
                n.score = Set(Some(id));
                Ok(())
            })
            .await
            .unwrap();
    }
    assert!(lock.is_empty());
}
