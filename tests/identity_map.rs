//! The session cache: hits send no SQL, misses are batched, resets are per id.

mod common;

use common::{memory_db_recorded, seed_nodes, session};
use entity::node;
use freshlock::Session;
use freshlock::lock::LocalLock;
use sea_orm::{EntityTrait, Set};

#[tokio::test]
async fn second_load_sends_no_sql_and_returns_the_same_arc() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 3).await;
    let session = session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    recorder.clear();

    let first = nodes.load(1).await.unwrap().unwrap();
    assert_eq!(recorder.take().len(), 1);
    let second = nodes.load(1).await.unwrap().unwrap();
    assert!(recorder.take().is_empty(), "a hit sends no SQL");
    assert!(std::sync::Arc::ptr_eq(&first, &second));
    assert!(nodes.load(42).await.unwrap().is_none());

    let stats = session.cache_stats();
    assert_eq!((stats.hits, stats.misses, stats.len), (1, 2, 1));
}

#[tokio::test]
async fn load_many_reads_all_misses_in_one_query_in_the_given_order() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 5).await;
    let session = session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    nodes.load(2).await.unwrap();
    recorder.clear();

    let rows = nodes.load_many([4, 2, 99, 1, 4]).await.unwrap();
    let ids: Vec<Option<i32>> = rows.iter().map(|r| r.as_ref().map(|m| m.id)).collect();
    assert_eq!(ids, vec![Some(4), Some(2), None, Some(1), Some(4)]);
    assert_eq!(recorder.take().len(), 1, "one query for the misses");
    nodes.load_many([1, 2, 4]).await.unwrap();
    assert!(recorder.take().is_empty(), "all cached now");
}

#[tokio::test]
async fn reset_cache_makes_the_next_load_read_the_database() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 2).await;
    let session = session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    nodes.load_many([1, 2]).await.unwrap();

    // Someone else writes behind the session's back.
    node::Entity::update(node::ActiveModel {
        id: Set(1),
        score: Set(Some(5)),
        ..Default::default()
    })
    .exec(&db)
    .await
    .unwrap();
    assert_eq!(
        nodes.load(1).await.unwrap().unwrap().score,
        None,
        "stale, by design"
    );

    assert_eq!(nodes.reset_cache([1, 7]).unwrap(), 1);
    recorder.clear();
    assert_eq!(nodes.load(1).await.unwrap().unwrap().score, Some(5));
    assert_eq!(recorder.take().len(), 1);
    assert_eq!(session.cache_stats().evictions, 1);

    // load_fresh always reads, and refreshes the cache.
    assert_eq!(nodes.load_fresh(2).await.unwrap().unwrap().id, 2);
    assert_eq!(recorder.take().len(), 1);

    assert_eq!(nodes.reset_cache_all(), 2);
    session.clear_cache();
    assert_eq!(session.cache_stats().len, 0);
}

#[tokio::test]
async fn a_bounded_cache_stays_at_its_cap() {
    let (db, _recorder) = memory_db_recorded().await;
    seed_nodes(&db, 50).await;
    let session = Session::builder(db.clone())
        .cache_capacity(10)
        .build()
        .unwrap();
    let nodes = session.repository::<node::Entity>();
    nodes.load_many(1..=50).await.unwrap();
    let stats = session.cache_stats();
    assert_eq!(stats.len, 10);
    assert_eq!(stats.evictions, 40);
}
