//! The optimistic guard on every write of `locked_update`: a row that changed between the reload
//! and the write is reloaded and `apply` runs again; past the bound, a typed conflict.

mod common;

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};

use common::{FakeLock, count, memory_db, memory_db_recorded, node_in_db, seed_nodes};
use entity::node;
use freshlock::testing::TestDatabase;
use freshlock::{Error, LockPolicy, Session};
use sea_orm::{ConnectionTrait, Schema, Set};

fn session(db: &sea_orm::DatabaseConnection, fake: &FakeLock) -> Session {
    Session::builder(db.clone())
        .lock(Arc::new(fake.clone()))
        .policy(LockPolicy::default().with_write_attempts(3))
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_row_changed_after_the_reload_is_reloaded_and_apply_runs_again() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let fake = FakeLock::new();
    // Someone adds 1000 to the score between our reload and our write, once.
    fake.interfere(
        "UPDATE node SET score = COALESCE(score, 0) + 1000 WHERE id = 1",
        1,
    );
    let runs = AtomicU32::new(0);
    let report = session(&db, &fake)
        .repository::<node::Entity>()
        .locked_update(1, |n| {
            runs.fetch_add(1, Ordering::SeqCst);
            let score = n.score.as_ref().unwrap_or(0);
            n.score = Set(Some(score + 1));
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!((report.attempts, report.conflicts), (2, 1));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "apply ran again on the fresh row"
    );
    // The interfering change was rolled back with the refused attempt; ours was applied once.
    assert_eq!(node_in_db(&db, 1).await.score, Some(1));
}

#[tokio::test]
async fn a_row_that_keeps_changing_is_a_typed_conflict_and_nothing_is_written() {
    let db = memory_db().await;
    seed_nodes(&db, 1).await;
    let fake = FakeLock::new();
    fake.interfere(
        "UPDATE node SET score = COALESCE(score, 0) + 1000 WHERE id = 1",
        u32::MAX,
    );
    let result = session(&db, &fake)
        .repository::<node::Entity>()
        .locked_update(1, |n| {
            n.score = Set(Some(7));
            Ok(())
        })
        .await;
    assert!(
        matches!(result, Err(Error::Conflict { attempts: 3, .. })),
        "{result:?}"
    );
    assert_eq!(node_in_db(&db, 1).await.score, None);
}

#[tokio::test]
async fn the_guard_compares_null_as_null_and_costs_no_statement() {
    let (db, recorder) = memory_db_recorded().await;
    seed_nodes(&db, 1).await;
    let fake = FakeLock::new();
    recorder.clear();
    session(&db, &fake)
        .repository::<node::Entity>()
        .locked_update(1, |n| {
            n.summary = Set(Some("from NULL".into()));
            Ok(())
        })
        .await
        .unwrap();
    let sql = recorder.take();
    assert_eq!(
        (count(&sql, "SELECT"), count(&sql, "UPDATE")),
        (1, 1),
        "{sql:#?}"
    );
    let update = sql.iter().find(|s| s.starts_with("UPDATE")).unwrap();
    assert!(update.contains("\"summary\" IS NULL"), "{update}");
}

mod document {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "document")]
    pub struct Model {
        #[sea_orm(primary_key)]
        pub id: i32,
        pub body: String,
        pub word_count: i32,
        pub version: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

#[tokio::test]
async fn a_declared_version_column_guards_and_grows_on_every_write() {
    let db = TestDatabase::new().await.unwrap();
    let schema = Schema::new(db.get_database_backend());
    db.execute(&schema.create_table_from_entity(document::Entity))
        .await
        .unwrap();
    db.execute_unprepared(
        "INSERT INTO document (id, body, word_count, version) VALUES (1, 'a b', 2, 0)",
    )
    .await
    .unwrap();
    let fake = FakeLock::new();
    let session = Session::builder(db.clone())
        .lock(Arc::new(fake.clone()))
        .version_column::<document::Entity>(document::Column::Version)
        .build()
        .unwrap();
    let docs = session.repository::<document::Entity>();
    // `apply` derives word_count from body: a column it reads but does not write, which only a
    // version column protects.
    let recount = |d: &mut document::ActiveModel| {
        let words = d.body.as_ref().split_whitespace().count() as i32;
        d.word_count = Set(words);
        d.body = Set(format!("{} c", d.body.as_ref()));
        Ok(())
    };
    let report = docs.locked_update(1, recount).await.unwrap();
    let model = report.outcome.model().unwrap().clone();
    assert_eq!((model.version, model.body.as_str()), (1, "a b c"));

    // Someone changes the body (and bumps the version) right before our write: refused, rerun.
    fake.interfere(
        "UPDATE document SET body = 'x y z w', version = version + 1 WHERE id = 1",
        1,
    );
    let report = docs.locked_update(1, recount).await.unwrap();
    assert_eq!(report.conflicts, 1);
    let model = report.outcome.model().unwrap().clone();
    assert_eq!(
        model.version, 2,
        "the refused attempt's bump was rolled back"
    );
    assert_eq!((model.body.as_str(), model.word_count), ("a b c c", 3));
}
