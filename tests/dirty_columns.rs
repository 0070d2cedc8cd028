//! Writes send only the changed columns, and nothing when nothing changed (captured SQL).

mod common;

use common::{count, memory_db_recorded, node_in_db, seed_nodes, session};
use entity::node;
use freshlock::lock::LocalLock;
use freshlock::{SaveOutcome, UpdateOutcome};
use sea_orm::{EntityTrait, IntoActiveModel, Set};

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
async fn save_writes_only_changed_columns_and_checks_the_rest() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 1).await;
    let session = session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    let cached = nodes.load(1).await.unwrap().unwrap();
    recorder.clear();

    // Nothing set → nothing to write and nothing to check: no SQL at all.
    let nothing = (*cached).clone().into_active_model();
    assert!(matches!(
        nodes.save(nothing).await.unwrap(),
        SaveOutcome::Unchanged
    ));
    assert!(recorder.take().is_empty());

    // Same values set: nothing to write, but the database (not the cache) must still hold
    // them → one guarded SELECT, no UPDATE.
    let mut same = (*cached).clone().into_active_model();
    same.title = Set(cached.title.clone());
    same.score = Set(cached.score);
    assert!(matches!(
        nodes.save(same).await.unwrap(),
        SaveOutcome::Unchanged
    ));
    let sql = recorder.take();
    assert_eq!(sql.len(), 1, "{sql:#?}");
    assert!(sql[0].starts_with("SELECT"), "{sql:#?}");
    assert!(sql[0].contains("\"title\" = 'node 1'"), "{}", sql[0]);

    // One real change among same-value sets → one UPDATE (RETURNING) of that column only,
    // checking both set columns.
    let mut changed = (*cached).clone().into_active_model();
    changed.title = Set(cached.title.clone());
    changed.summary = Set(Some("short".into()));
    let SaveOutcome::Updated(committed) = nodes.save(changed).await.unwrap() else {
        panic!("expected an update");
    };
    let sql = recorder.take();
    assert_eq!(sql.len(), 1, "{sql:#?}");
    assert!(sql[0].starts_with("UPDATE"), "{sql:#?}");
    let (set, guard) = sql[0].split_once(" WHERE ").unwrap();
    assert!(set.contains("\"summary\" = 'short'"), "{}", sql[0]);
    assert!(!set.contains("\"title\" ="), "{}", sql[0]);
    assert!(guard.contains("\"summary\" IS NULL"), "{}", sql[0]);
    assert!(guard.contains("\"title\" = 'node 1'"), "{}", sql[0]);
    // The cache holds the row as committed: the next load sends nothing and sees the change.
    assert_eq!(*committed, node_in_db(&db, 1).await);
    recorder.clear();
    assert_eq!(nodes.load(1).await.unwrap().unwrap(), committed);
    assert!(recorder.take().is_empty());
}

#[tokio::test]
async fn save_without_a_snapshot_or_with_a_set_key_is_refused_and_writes_nothing() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 2).await;
    let session = session(&db, &LocalLock::new());
    let nodes = session.repository::<node::Entity>();
    recorder.clear();

    // Never loaded: nothing to check the write against.
    let partial = node::ActiveModel {
        id: sea_orm::ActiveValue::Unchanged(2),
        score: Set(Some(9)),
        ..Default::default()
    };
    assert!(matches!(
        nodes.save(partial).await,
        Err(freshlock::Error::NoSnapshot { .. })
    ));
    // A primary key that is Set: a save cannot move a row.
    nodes.load(2).await.unwrap();
    let moved = node::ActiveModel {
        id: Set(2),
        score: Set(Some(9)),
        ..Default::default()
    };
    assert!(matches!(
        nodes.save(moved).await,
        Err(freshlock::Error::InvalidKey { entity: "node", .. })
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
    assert_eq!(count(&recorder.take(), "UPDATE"), 0);
    assert_eq!(node_in_db(&db, 2).await.score, None);

    // A row deleted behind the snapshot's back → NotFound, and the cache forgets it.
    let cached = nodes.load(1).await.unwrap().unwrap();
    node::Entity::delete_by_id(1).exec(&db).await.unwrap();
    let mut ghost = (*cached).clone().into_active_model();
    ghost.score = Set(Some(1));
    assert!(matches!(
        nodes.save(ghost).await.unwrap(),
        SaveOutcome::NotFound
    ));
    recorder.clear();
    assert!(nodes.load(1).await.unwrap().is_none());
    assert_eq!(
        count(&recorder.take(), "SELECT"),
        1,
        "evicted, so read again"
    );
}
