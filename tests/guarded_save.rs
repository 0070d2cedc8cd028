//! `save` is an optimistic write checked against the session's snapshot: concurrent savers from
//! cached snapshots never lose an increment, a stale value equal to the cached one is a conflict,
//! a declared version column refuses a stale snapshot. On in-memory SQLite, a SQLite file,
//! PostgreSQL and MariaDB.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};

use entity::node;
use freshlock::{Error, SaveOutcome, Session};
use sea_orm::{ConnectionTrait, DatabaseConnection, EntityTrait, IntoActiveModel, Schema, Set};
use servers::{TestDb, databases};
use tokio::sync::Barrier;

/// An entity with a declared version column (and a text column that is not one).
mod account {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "account")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i32,
        pub cents: i64,
        pub owner: String,
        pub version: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

async fn create_accounts(db: &DatabaseConnection) {
    let create = Schema::new(db.get_database_backend()).create_table_from_entity(account::Entity);
    db.execute(&create).await.expect("create account");
    account::Entity::insert(account::ActiveModel {
        id: Set(1),
        cents: Set(1200),
        owner: Set("ann".into()),
        version: Set(0),
    })
    .exec(db)
    .await
    .expect("seed account");
}

fn versioned(db: &DatabaseConnection) -> Session {
    Session::builder(db.clone())
        .version_column::<account::Entity>(account::Column::Version)
        .build()
        .expect("valid session")
}

/// 8 sessions, 50 rounds: in each round every session loads node 1 (its snapshot), all meet at
/// a barrier, then each saves `score + 1` from its snapshot, reloading and trying again on
/// `Conflict`. Every acknowledged save must be in the counter, exactly once.
async fn increments_from_snapshots(db: DatabaseConnection) {
    const SESSIONS: usize = 8;
    const ROUNDS: u32 = 50;
    node::Entity::insert(node::ActiveModel::fresh(1))
        .exec(&db)
        .await
        .unwrap();
    let barrier = Arc::new(Barrier::new(SESSIONS));
    let (updated, conflicts) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let tasks: Vec<_> = (0..SESSIONS)
        .map(|_| {
            let session = Session::new(db.clone());
            let (barrier, updated, conflicts) = (
                Arc::clone(&barrier),
                Arc::clone(&updated),
                Arc::clone(&conflicts),
            );
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                for _ in 0..ROUNDS {
                    let mut snapshot = nodes.load(1).await.unwrap().unwrap();
                    barrier.wait().await;
                    loop {
                        let mut change = (*snapshot).clone().into_active_model();
                        change.score = Set(Some(snapshot.score.unwrap_or(0) + 1));
                        match nodes.save(change).await.unwrap() {
                            SaveOutcome::Updated(stored) => {
                                assert_eq!(stored.score, Some(snapshot.score.unwrap_or(0) + 1));
                                updated.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                            SaveOutcome::Conflict => {
                                conflicts.fetch_add(1, Ordering::SeqCst);
                                // The cache forgot the row: this load reads the database.
                                snapshot = nodes.load(1).await.unwrap().unwrap();
                            }
                            other => panic!("unexpected {other:?}"),
                        }
                    }
                    barrier.wait().await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let updated = updated.load(Ordering::SeqCst);
    let conflicts = conflicts.load(Ordering::SeqCst);
    let stored = node::Entity::find_by_id(1)
        .one(&db)
        .await
        .unwrap()
        .unwrap()
        .score
        .unwrap_or(0) as u32;
    eprintln!("saves from snapshots: {updated} updated, {conflicts} conflicts, counter {stored}");
    assert_eq!(updated, SESSIONS as u32 * ROUNDS);
    assert_eq!(
        stored, updated,
        "every acknowledged save is in the counter once"
    );
    // Every round starts with all sessions holding the same snapshot: all but one conflict.
    assert!(conflicts >= (SESSIONS as u32 - 1) * ROUNDS, "{conflicts}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn increments_from_snapshots_in_memory() {
    increments_from_snapshots(common::memory_db().await).await;
}

async fn increments_on(db: Option<TestDb>, _: ()) {
    if let Some(db) = db {
        increments_from_snapshots(db.db).await;
    }
}

/// A stale snapshot whose value equals what the caller sets is no proof: A cached 1000, B
/// stored 1299, A's save of 1000 is a conflict (not `Unchanged`), and the database keeps 1299.
async fn stale_equal_value_is_a_conflict(db: DatabaseConnection) {
    node::Entity::insert(node::ActiveModel {
        score: Set(Some(1000)),
        ..node::ActiveModel::fresh(1)
    })
    .exec(&db)
    .await
    .unwrap();
    let (a, b) = (
        Session::new(db.clone()).repository::<node::Entity>(),
        Session::new(db.clone()).repository::<node::Entity>(),
    );
    let seen_by_a = a.load(1).await.unwrap().unwrap();
    let seen_by_b = b.load(1).await.unwrap().unwrap();
    let mut raise = (*seen_by_b).clone().into_active_model();
    raise.score = Set(Some(1299));
    assert!(matches!(
        b.save(raise).await.unwrap(),
        SaveOutcome::Updated(_)
    ));

    let mut same = (*seen_by_a).clone().into_active_model();
    same.score = Set(Some(1000));
    assert!(matches!(a.save(same).await.unwrap(), SaveOutcome::Conflict));
    let stored = node::Entity::find_by_id(1).one(&db).await.unwrap().unwrap();
    assert_eq!(stored.score, Some(1299));
    // A's cache forgot the stale row: the next load shows the truth.
    assert_eq!(a.load(1).await.unwrap().unwrap().score, Some(1299));
}

/// With a version column: a snapshot older than a `locked_update` is refused (12.00 stays, the
/// cache and the database agree on the version), the same save from a fresh load goes through
/// and increments the version, and a model built from an older copy than the session's cached
/// row is refused without a statement.
async fn version_column_refuses_a_stale_snapshot(db: DatabaseConnection) {
    create_accounts(&db).await;
    let (a, b) = (versioned(&db), versioned(&db));
    let (accounts_a, accounts_b) = (
        a.repository::<account::Entity>(),
        b.repository::<account::Entity>(),
    );
    let snapshot = accounts_a.load(1).await.unwrap().unwrap();
    let report = accounts_b
        .locked_update(1, |account| {
            account.cents = Set(1200);
            account.owner = Set("bob".into());
            Ok(())
        })
        .await
        .unwrap();
    assert!(report.outcome.is_updated());

    let mut lower = (*snapshot).clone().into_active_model();
    lower.cents = Set(900);
    assert!(matches!(
        accounts_a.save(lower).await.unwrap(),
        SaveOutcome::Conflict
    ));
    let stored = account::Entity::find_by_id(1)
        .one(&db)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((stored.cents, stored.version), (1200, 1));

    let fresh = accounts_a.load(1).await.unwrap().unwrap();
    assert_eq!(fresh.version, 1);
    let mut lower = (*fresh).clone().into_active_model();
    lower.cents = Set(900);
    let SaveOutcome::Updated(saved) = accounts_a.save(lower).await.unwrap() else {
        panic!("a save from a fresh snapshot goes through");
    };
    assert_eq!((saved.cents, saved.version), (900, 2));
    assert_eq!(
        *saved,
        account::Entity::find_by_id(1)
            .one(&db)
            .await
            .unwrap()
            .unwrap()
    );

    // Same session: a model built from `fresh` (version 1) after the session's own locked
    // update moved the cached row to version 3 is a conflict, though the cache is current.
    let mut from_old_copy = (*fresh).clone().into_active_model();
    accounts_a
        .locked_update(1, |account| {
            account.owner = Set("cy".into());
            Ok(())
        })
        .await
        .unwrap();
    from_old_copy.cents = Set(1);
    assert!(matches!(
        accounts_a.save(from_old_copy).await.unwrap(),
        SaveOutcome::Conflict
    ));
    let stored = account::Entity::find_by_id(1)
        .one(&db)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (stored.cents, stored.owner.as_str(), stored.version),
        (900, "cy", 3)
    );
}

async fn stale_equal_on(db: Option<TestDb>, _: ()) {
    if let Some(db) = db {
        stale_equal_value_is_a_conflict(db.db).await;
    }
}

async fn version_on(db: Option<TestDb>, _: ()) {
    if let Some(db) = db {
        version_column_refuses_a_stale_snapshot(db.db).await;
    }
}

#[tokio::test]
async fn stale_equal_value_is_a_conflict_in_memory() {
    stale_equal_value_is_a_conflict(common::memory_db().await).await;
}

#[tokio::test]
async fn version_column_refuses_a_stale_snapshot_in_memory() {
    version_column_refuses_a_stale_snapshot(common::memory_db().await).await;
}

#[tokio::test]
async fn a_version_column_that_is_not_an_integer_is_refused_at_build() {
    let db = common::memory_db().await;
    let built = Session::builder(db)
        .version_column::<account::Entity>(account::Column::Owner)
        .build();
    assert!(matches!(
        built,
        Err(Error::VersionColumn {
            entity: "account",
            column: "owner"
        })
    ));
}

servers::server_tests! {
    increments_sqlite_file: increments_on, (), sqlite;
    increments_postgres: increments_on, (), postgres;
    increments_mysql: increments_on, (), mysql;
    stale_equal_sqlite_file: stale_equal_on, (), sqlite;
    stale_equal_postgres: stale_equal_on, (), postgres;
    stale_equal_mysql: stale_equal_on, (), mysql;
    version_sqlite_file: version_on, (), sqlite;
    version_postgres: version_on, (), postgres;
    version_mysql: version_on, (), mysql;
}
