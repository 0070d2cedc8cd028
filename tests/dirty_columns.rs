//! Writes send only the changed columns, and nothing when nothing changed (captured SQL).

mod common;

use common::{count, memory_db_recorded, node_in_db, seed_nodes, session};
use entity::node;
use freshlock::{LocalLock, SaveOutcome, UpdateOutcome};
use sea_orm::{ActiveValue::NotSet, IntoActiveModel, Set};

#[tokio::test]
async fn locked_update_sends_one_select_and_one_update_of_the_dirty_column() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 1).await;
    let session = session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    recorder.clear();

    let report = nodes
        .locked_update(1, |n| {
            n.score = Set(Some(7));
            Ok(())
        })
        .await
        .unwrap();
    assert!(report.outcome.is_updated());

    let sql = recorder.take();
    assert_eq!(count(&sql, "SELECT"), 1, "{sql:#?}");
    assert_eq!(count(&sql, "UPDATE"), 1, "{sql:#?}");
    assert_eq!(sql.len(), 2, "{sql:#?}");
    let update = sql.iter().find(|s| s.starts_with("UPDATE")).unwrap();
    assert!(update.contains("\"score\" = 7"), "{update}");
    for other in ["title", "thumbnail", "summary", "analysis", "changed"] {
        assert!(
            !update.contains(&format!("\"{other}\" =")),
            "{other} written: {update}"
        );
    }
}

#[tokio::test]
async fn locked_update_that_changes_nothing_sends_no_update() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 1).await;
    let session = session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    recorder.clear();

    // Setting a column to the value it already has is not a change.
    let report = nodes
        .locked_update(1, |n| {
            n.title = Set("node 1".into());
            n.score = Set(None);
            Ok(())
        })
        .await
        .unwrap();
    assert!(matches!(report.outcome, UpdateOutcome::Unchanged(_)));
    let sql = recorder.take();
    assert_eq!(count(&sql, "UPDATE"), 0, "{sql:#?}");
    assert_eq!(count(&sql, "SELECT"), 1, "{sql:#?}");
}

#[tokio::test]
async fn save_writes_only_changed_columns_and_nothing_when_unchanged() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 1).await;
    let session = session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    let cached = nodes.load(1).await.unwrap().unwrap();
    recorder.clear();

    // Same values set: compared with the cached row, nothing changed → no SQL at all.
    let mut same = (*cached).clone().into_active_model();
    same.title = Set(cached.title.clone());
    same.score = Set(cached.score);
    assert!(matches!(
        nodes.save(same).await.unwrap(),
        SaveOutcome::Unchanged
    ));
    assert!(recorder.take().is_empty());

    // One real change among same-value sets → one UPDATE of that column only.
    let mut changed = (*cached).clone().into_active_model();
    changed.title = Set(cached.title.clone());
    changed.summary = Set(Some("short".into()));
    let SaveOutcome::Updated(committed) = nodes.save(changed).await.unwrap() else {
        panic!("expected an update");
    };
    let sql = recorder.take();
    assert_eq!(sql.len(), 1, "{sql:#?}");
    assert!(sql[0].starts_with("UPDATE"), "{sql:#?}");
    assert!(sql[0].contains("\"summary\" = 'short'"), "{}", sql[0]);
    assert!(!sql[0].contains("\"title\" ="), "{}", sql[0]);
    // The cache holds the row as committed: the next load sends nothing and sees the change.
    assert_eq!(*committed, node_in_db(&db, 1).await);
    recorder.clear();
    assert_eq!(nodes.load(1).await.unwrap().unwrap(), committed);
    assert!(recorder.take().is_empty());
}

#[tokio::test]
async fn save_of_an_uncached_row_writes_the_set_columns_and_caches_the_result() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 2).await;
    let session = session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    recorder.clear();

    let partial = node::ActiveModel {
        id: Set(2),
        score: Set(Some(9)),
        ..Default::default()
    };
    let SaveOutcome::Updated(committed) = nodes.save(partial).await.unwrap() else {
        panic!("expected an update");
    };
    assert_eq!(committed.score, Some(9));
    assert_eq!(
        committed.title, "node 2",
        "the full committed row is cached"
    );
    let sql = recorder.take();
    let update = sql.iter().find(|s| s.starts_with("UPDATE")).unwrap();
    assert!(!update.contains("\"title\" ="), "{update}");

    // Nothing set → nothing sent; missing row → NotFound, not an error.
    let nothing = node::ActiveModel {
        id: Set(2),
        title: NotSet,
        ..Default::default()
    };
    assert!(matches!(
        nodes.save(nothing).await.unwrap(),
        SaveOutcome::Unchanged
    ));
    let ghost = node::ActiveModel {
        id: Set(99),
        score: Set(Some(1)),
        ..Default::default()
    };
    assert!(matches!(
        nodes.save(ghost).await.unwrap(),
        SaveOutcome::NotFound
    ));
    // No primary key → a typed error.
    let keyless = node::ActiveModel {
        score: Set(Some(1)),
        ..Default::default()
    };
    assert!(matches!(
        nodes.save(keyless).await,
        Err(freshlock::Error::InvalidKey { entity: "node", .. })
    ));
}
