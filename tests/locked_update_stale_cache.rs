//! The Drupal report's exact bug: a reload inside the lock that comes from the entity cache.

mod common;

use common::{memory_db, node_in_db, seed_nodes, session};
use entity::node;
use freshlock::UpdateOutcome;
use freshlock::lock::LocalLock;
use sea_orm::{ActiveModelTrait, IntoActiveModel, Set};

#[tokio::test]
async fn a_cached_load_before_the_heavy_work_does_not_erase_another_workers_field() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let lock = LocalLock::new();
    let worker_a = session(&db, &lock);
    let worker_b = session(&db, &lock);

    // A loads node 1 for its heavy work: it is now in A's cache.
    let for_work = worker_a
        .repository::<node::Entity>()
        .load(1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(for_work.score, None);

    // Meanwhile B stores its score.
    let b = worker_b.repository::<node::Entity>();
    let report = b.locked_update(1, |n| {
        n.score = Set(Some(42));
        Ok(())
    });
    assert!(report.await.unwrap().outcome.is_updated());

    // A finishes and stores its thumbnail through the lock.
    let a = worker_a.repository::<node::Entity>();
    let report = a
        .locked_update(1, |n| {
            n.thumbnail = Set(Some("thumb.png".into()));
            Ok(())
        })
        .await
        .unwrap();
    let UpdateOutcome::Updated(committed) = report.outcome else {
        panic!("expected an update, got {:?}", report.outcome);
    };
    assert!(report.lock.held);

    let stored = node_in_db(&db, 1).await;
    assert_eq!(stored.score, Some(42), "B's score survived");
    assert_eq!(stored.thumbnail.as_deref(), Some("thumb.png"));
    // A's cache now holds the row as committed, not its stale snapshot.
    assert_eq!(*committed, stored);
    assert_eq!(*a.load(1).await.unwrap().unwrap(), stored);
}

#[tokio::test]
async fn the_hazard_a_cached_load_and_full_row_save_lose_the_other_field() {
    // What the library removes: the same steps written with a cached snapshot saved whole.
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let lock = LocalLock::new();
    let worker_a = session(&db, &lock);
    let worker_b = session(&db, &lock);

    let snapshot = worker_a
        .repository::<node::Entity>()
        .load(1)
        .await
        .unwrap()
        .unwrap();
    let b = worker_b.repository::<node::Entity>();
    b.locked_update(1, |n| {
        n.score = Set(Some(42));
        Ok(())
    })
    .await
    .unwrap();

    // "Reload" through the cache (the seed's failed fix), set the field, save every column.
    let stale = worker_a
        .repository::<node::Entity>()
        .load(1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stale, snapshot, "the cache served the old snapshot");
    let mut full = (*stale).clone().into_active_model();
    full.thumbnail = Set(Some("thumb.png".into()));
    full.score = Set(stale.score); // a full-row save writes every column back
    full.title = Set(stale.title.clone());
    full.update(&db).await.unwrap();

    let stored = node_in_db(&db, 1).await;
    assert_eq!(stored.thumbnail.as_deref(), Some("thumb.png"));
    assert_eq!(
        stored.score, None,
        "B's score was erased by the stale full-row save"
    );
}
