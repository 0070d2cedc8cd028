//! The Django report's point, on PostgreSQL and MariaDB: while a worker holds the lock row of a
//! Ham, other connections read and update the Ham itself without waiting; locking the Ham row
//! itself (the report's first approach) blocks them.

#[path = "common/servers.rs"]
mod servers;

use std::time::Duration;

use entity::ham;
use freshlock::lock::backend::TransactionLock;
use freshlock::lock::{LockName, RowLock};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, EntityTrait, QuerySelect, Set, TransactionTrait,
};
use servers::TestDb;

async fn seed_ham(db: &DatabaseConnection) {
    ham::Entity::insert(ham::ActiveModel {
        id: Set(1),
        name: Set("ham".into()),
        updated_at: Set(0),
    })
    .exec(db)
    .await
    .unwrap();
}

/// An update of the Ham from another connection that gives up after a short lock wait; returns
/// whether it went through.
async fn update_ham_elsewhere(db: &DatabaseConnection) -> bool {
    let txn = db.begin().await.unwrap();
    let bound = match db.get_database_backend() {
        DbBackend::Postgres => "SET LOCAL lock_timeout = '300ms'",
        _ => "SET SESSION innodb_lock_wait_timeout = 1",
    };
    txn.execute_unprepared(bound).await.unwrap();
    let read = ham::Entity::find_by_id(1).one(&txn).await.unwrap();
    assert!(read.is_some(), "reads never wait");
    let updated = ham::Entity::update(ham::ActiveModel {
        id: Set(1),
        updated_at: Set(42),
        ..Default::default()
    })
    .exec(&txn)
    .await;
    let went_through = updated.is_ok();
    if went_through {
        txn.commit().await.unwrap();
    } else {
        txn.rollback().await.ok();
    }
    if db.get_database_backend() == DbBackend::MySql {
        db.execute_unprepared("SET SESSION innodb_lock_wait_timeout = DEFAULT")
            .await
            .ok();
    }
    went_through
}

async fn parent_stays_free(test_db: Option<TestDb>) {
    let Some(test_db) = test_db else { return };
    let db = &test_db.db;
    seed_ham(db).await;

    // A worker holds the Ham's lock row for its whole (short) transaction.
    let worker = db.begin().await.unwrap();
    let locked = RowLock::new(db.clone())
        .lock_in_transaction(&worker, &LockName::new("ham:1").unwrap(), Duration::ZERO)
        .await
        .unwrap();
    assert!(locked);
    assert!(
        update_ham_elsewhere(db).await,
        "the Ham row is free while its lock row is held"
    );
    worker.commit().await.unwrap();

    // The contrast: the report's first approach locks the Ham row itself.
    let worker = db.begin().await.unwrap();
    ham::Entity::find_by_id(1)
        .lock_exclusive()
        .one(&worker)
        .await
        .unwrap();
    assert!(
        !update_ham_elsewhere(db).await,
        "locking the Ham row blocks everyone else's updates of it"
    );
    worker.rollback().await.unwrap();
}

#[tokio::test]
async fn postgres_parent_row_stays_free() {
    parent_stays_free(servers::databases::postgres("parent_pg").await).await;
}

#[tokio::test]
async fn mariadb_parent_row_stays_free() {
    parent_stays_free(servers::databases::mysql("parent_my").await).await;
}
