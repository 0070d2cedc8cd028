//! The `table` backend's lease ends with the write's own commit: the fence check in the write's
//! transaction also frees the lease row, so no release statement (and no commit of its own)
//! follows the write, and the name is free the moment the write is visible.

mod common;

use std::sync::Arc;

use entity::node;
use freshlock::Session;
use freshlock::lock::TableLock;
use sea_orm::{ConnectionTrait, DatabaseConnection, EntityTrait, Set, Statement};

/// A session on `db` under the `table` backend.
fn table_session(db: &DatabaseConnection) -> Session {
    Session::builder(db.clone())
        .lock(Arc::new(TableLock::new(db.clone())))
        .build()
        .expect("session")
}

/// The statements `recorder` saw that touch the lease table.
fn lease_statements(recorder: &common::Recorder) -> Vec<String> {
    (recorder.statements().into_iter())
        .filter(|sql| sql.contains("freshlock_lock"))
        .collect()
}

/// The owner of the lease row of `name` (`None`: free).
async fn lease_owner(db: &DatabaseConnection, name: &str) -> Option<String> {
    db.query_one_raw(Statement::from_sql_and_values(
        db.get_database_backend(),
        "SELECT owner FROM freshlock_lock WHERE name = ?",
        [name.into()],
    ))
    .await
    .expect("read")
    .expect("lease row")
    .try_get::<Option<String>>("", "owner")
    .expect("owner")
}

#[tokio::test]
async fn the_write_commits_the_release() {
    let (db, recorder) = common::memory_db_recorded().await;
    common::seed_nodes(&db, 1).await;
    let session = table_session(&db);
    let nodes = session.repository::<node::Entity>();
    for round in 1..=3 {
        recorder.clear();
        let report = nodes
            .locked_update(1, |n| {
                n.score = Set(Some(round));
                Ok(())
            })
            .await
            .expect("written");
        assert!(report.outcome.is_updated());
        assert!(report.lock.held && report.lock.release_error.is_none());
        let lease_statements = lease_statements(&recorder);
        assert_eq!(
            lease_statements.len(),
            2,
            "take the lease, then check and free it in the write: {lease_statements:?}"
        );
        assert!(
            lease_statements[1].starts_with("UPDATE")
                && lease_statements[1].contains("AND fence = "),
            "{lease_statements:?}"
        );
        // Free once the write is visible: the next taker gets it at once.
        let owner = lease_owner(&db, "node:1").await;
        assert_eq!(owner, None, "round {round}: released by the commit");
    }
    assert_eq!(common::node_in_db(&db, 1).await.score, Some(3));
}

/// `locked_delete` frees the lease in its transaction too: the lease's two statements (the grant;
/// the check that frees it), no release after the commit, and the name free once the row is
/// gone (before, a release statement — and on a server its own commit — followed the delete).
#[tokio::test]
async fn the_delete_commits_the_release() {
    let (db, recorder) = common::memory_db_recorded().await;
    common::seed_nodes(&db, 3).await;
    let session = table_session(&db);
    let nodes = session.repository::<node::Entity>();
    for id in 1..=3 {
        recorder.clear();
        let report = nodes.locked_delete(id).await.expect("deleted");
        assert!(
            matches!(report.outcome, freshlock::DeleteOutcome::Deleted(_)),
            "{:?}",
            report.outcome
        );
        assert!(report.lock.held && report.lock.release_error.is_none());
        let lease_statements = lease_statements(&recorder);
        assert_eq!(
            lease_statements.len(),
            2,
            "take the lease, then check and free it in the delete: {lease_statements:?}"
        );
        let owner = lease_owner(&db, &format!("node:{id}")).await;
        assert_eq!(owner, None, "node {id}: released by the commit");
    }
    let left = node::Entity::find().all(&db).await.expect("rows");
    assert!(left.is_empty(), "{left:?}");
}
