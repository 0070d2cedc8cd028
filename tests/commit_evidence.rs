//! PostgreSQL's evidence of commit: the transaction's id, trusted only within one server
//! incarnation (`freshlock_incarnation`, an UNLOGGED table that crash recovery empties).
//!
//! - Locked writes, sections and claims write no marker row while the incarnation is known; the
//!   first write after the table was emptied (new, or by crash recovery) carries a marker and
//!   starts a new incarnation.
//! - A `COMMIT` whose reply is lost is resolved by `txid_status` while the incarnation stands,
//!   and is `Error::CommitUnknown` — never "committed" — once it changed between the write and
//!   the resolution, which is when its id may have gone to another transaction.
//! - Without the table (migrations not run), writes keep their markers and still resolve.
//!
//! The crash itself (ids really handed out twice) is `tests/backend_kill.rs`: its PostgreSQL
//! runs lose acknowledged writes when the resolution ignores the incarnation.

mod common;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use freshlock::claim::{ClaimOutcome, Claims, FinishOutcome};
use freshlock::lock::LockName;
use freshlock::{Error, Session, UpdateOutcome};
use proxy::{CutAfter, Proxy};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Set, Statement};
use servers::{TestDb, databases};

/// While set, an item's `after_save` replaces the server incarnation inside the write's own
/// transaction: after its commit the incarnation the write saw is gone, as after crash
/// recovery between the write and the resolution of its lost reply.
static NEW_INCARNATION: AtomicBool = AtomicBool::new(false);

/// While set, an item's `after_save` replaces the server incarnation on another connection
/// (`OUTSIDE`, autocommit): the change stands even when the write's transaction rolls back.
static NEW_INCARNATION_OUTSIDE: AtomicBool = AtomicBool::new(false);
static OUTSIDE: std::sync::OnceLock<DatabaseConnection> = std::sync::OnceLock::new();

/// The flags above are process-wide, and `cargo test` runs a binary's tests on threads of one
/// process: each test holds this for its whole run, so no hook sees another test's flag (with
/// both flags on, the hook's own transaction and `OUTSIDE` would wait on each other's row).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

mod item {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "evidence_item")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i32,
        pub n: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    #[async_trait::async_trait]
    impl ActiveModelBehavior for ActiveModel {
        async fn after_save<C: ConnectionTrait>(
            model: Model,
            db: &C,
            _insert: bool,
        ) -> Result<Model, DbErr> {
            let replace = "UPDATE freshlock_incarnation SET token = 'after-a-crash' WHERE id = 1";
            if super::NEW_INCARNATION.load(std::sync::atomic::Ordering::SeqCst) {
                db.execute_unprepared(replace).await?;
            }
            if super::NEW_INCARNATION_OUTSIDE.load(std::sync::atomic::Ordering::SeqCst)
                && let Some(outside) = super::OUTSIDE.get()
            {
                outside.execute_unprepared(replace).await?;
            }
            Ok(model)
        }
    }
}

async fn count(db: &DatabaseConnection, sql: &str) -> i64 {
    let row = db
        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<i64>(0).unwrap()
}

async fn markers(db: &DatabaseConnection) -> i64 {
    count(db, "SELECT COUNT(*) FROM freshlock_commit").await
}

async fn incarnation(db: &DatabaseConnection) -> Option<String> {
    db.query_one_raw(Statement::from_string(
        DbBackend::Postgres,
        "SELECT token FROM freshlock_incarnation WHERE id = 1",
    ))
    .await
    .unwrap()
    .map(|row| row.try_get_by_index::<String>(0).unwrap())
}

async fn items_table(db: &TestDb) {
    db.db
        .execute_unprepared(
            "CREATE TABLE evidence_item (id INTEGER PRIMARY KEY, n INTEGER NOT NULL); \
             INSERT INTO evidence_item VALUES (1, 0)",
        )
        .await
        .unwrap();
}

async fn stored_n(db: &DatabaseConnection) -> i64 {
    count(db, "SELECT n::bigint FROM evidence_item WHERE id = 1").await
}

/// `db`'s server through `proxy`, on the test's schema.
async fn through(proxy: &Proxy, db: &TestDb) -> DatabaseConnection {
    let mut options = sea_orm::ConnectOptions::new(proxy.url(&db.url));
    options
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    if let Some(schema) = &db.schema {
        options.set_schema_search_path(schema);
    }
    sea_orm::Database::connect(options).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_writes_leave_no_marker_rows_within_an_incarnation() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(db) = databases::postgres("evidence_markers").await else {
        return;
    };
    items_table(&db).await;
    assert_eq!(incarnation(&db.db).await, None, "a fresh table is empty");
    let session = Session::new(db.db.clone());
    let items = session.repository::<item::Entity>();
    let increment = |i: &mut item::ActiveModel| {
        let n = i.n.as_ref();
        i.n = Set(n + 1);
        Ok(())
    };

    // The first write finds no incarnation: it carries a marker and starts one.
    items.locked_update(1, increment).await.unwrap();
    assert_eq!(markers(&db.db).await, 1);
    let first = incarnation(&db.db)
        .await
        .expect("the first write started an incarnation");

    // Then no write leaves a marker: locked writes, sections and claims.
    for _ in 0..20 {
        let report = items.locked_update(1, increment).await.unwrap();
        assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
    }
    let section = LockName::new("evidence-section").unwrap();
    let report = session
        .with_lock(&section, |txn| {
            Box::pin(async move {
                txn.execute_unprepared("UPDATE evidence_item SET n = n + 1 WHERE id = 1")
                    .await?;
                Ok(())
            })
        })
        .await
        .unwrap();
    assert!(report.lock.held);
    let claims = Claims::new(db.db.clone());
    let key = LockName::new("evidence-claim").unwrap();
    let ClaimOutcome::Claimed(claim) = claims.claim(&key, Duration::from_secs(60)).await.unwrap()
    else {
        panic!("a new claim is ours");
    };
    assert_eq!(
        claims.finish(&claim).await.unwrap(),
        FinishOutcome::Finished
    );
    assert_eq!(markers(&db.db).await, 1, "no marker within the incarnation");
    assert_eq!(
        stored_n(&db.db).await,
        22,
        "every acknowledged write is stored once"
    );

    // Crash recovery empties the table (and ends every connection: here a pool of its own,
    // which has seen no token yet). Its first write reads the table, carries a marker and
    // starts a new incarnation; the ones after it write none. (A pool that saw the old token
    // reads again within `pool::INCARNATION_FRESH`, 1 s; until then a lost reply of its writes
    // is never misread, see `a_lost_reply_is_resolved_…`.)
    db.db
        .execute_unprepared("TRUNCATE freshlock_incarnation")
        .await
        .unwrap();
    let reconnected = servers::connect(&db.url, db.schema.as_deref(), 2).await;
    let items = Session::new(reconnected).repository::<item::Entity>();
    items.locked_update(1, increment).await.unwrap();
    let second = incarnation(&db.db).await.expect("a new incarnation");
    assert_ne!(first, second, "an incarnation's token is never used again");
    assert_eq!(markers(&db.db).await, 2);
    for _ in 0..5 {
        items.locked_update(1, increment).await.unwrap();
    }
    assert_eq!(markers(&db.db).await, 2);
    assert_eq!(stored_n(&db.db).await, 28);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_is_resolved_within_an_incarnation_and_unknown_across_two() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(db) = databases::postgres("evidence_lost").await else {
        return;
    };
    items_table(&db).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let proxied = through(&proxy, &db).await;
    let session = Session::new(proxied.clone());
    let items = session.repository::<item::Entity>();
    let set = |n: i32| {
        move |i: &mut item::ActiveModel| {
            i.n = Set(n);
            Ok(())
        }
    };
    items.locked_update(1, set(1)).await.unwrap();
    assert!(incarnation(&db.db).await.is_some());

    // The reply of a committed write is lost; the incarnation stands: resolved, committed,
    // acknowledged once.
    proxy.cut_once();
    let report = items.locked_update(1, set(2)).await.unwrap();
    assert_eq!(proxy.cuts(), 1, "the commit's reply was cut");
    assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
    assert_eq!(report.attempts, 1, "resolved as committed, not run again");
    assert_eq!(stored_n(&db.db).await, 2);

    // The same, but the incarnation changed before the resolution: the transaction id proves
    // nothing any more, so the outcome is unknown (it did commit here; after a real crash the
    // id may be another transaction's, whose commit would read as this one's).
    NEW_INCARNATION.store(true, Ordering::SeqCst);
    proxy.cut_once();
    let lost = items.locked_update(1, set(3)).await;
    NEW_INCARNATION.store(false, Ordering::SeqCst);
    assert_eq!(proxy.cuts(), 2, "the commit's reply was cut");
    assert!(
        matches!(lost, Err(Error::CommitUnknown { .. })),
        "across incarnations the outcome is unknown: {lost:?}"
    );
    assert_eq!(stored_n(&db.db).await, 3, "the write committed once");
}

/// A write whose `COMMIT` fails on the server (a deferred unique check) and whose reply is lost,
/// while the incarnation changes: its id reads `aborted`, which proves it absent in any
/// incarnation (a durable commit would read `committed`), so it is run again — and fails
/// again, now with the database's own error — rather than reported unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_commit_is_absent_even_across_incarnations() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(db) = databases::postgres("evidence_aborted").await else {
        return;
    };
    db.db
        .execute_unprepared(
            "CREATE TABLE evidence_item (id INTEGER PRIMARY KEY, n INTEGER NOT NULL \
             UNIQUE DEFERRABLE INITIALLY DEFERRED); \
             INSERT INTO evidence_item VALUES (1, 0), (2, 5)",
        )
        .await
        .unwrap();
    OUTSIDE.set(db.db.clone()).unwrap();
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let proxied = through(&proxy, &db).await;
    let items = Session::new(proxied).repository::<item::Entity>();
    items
        .locked_update(1, |i| {
            i.n = Set(1);
            Ok(())
        })
        .await
        .unwrap();
    assert!(incarnation(&db.db).await.is_some());

    NEW_INCARNATION_OUTSIDE.store(true, Ordering::SeqCst);
    proxy.cut_once();
    let failed = items
        .locked_update(1, |i| {
            i.n = Set(5); // row 2's value: the deferred check fails at COMMIT
            Ok(())
        })
        .await;
    NEW_INCARNATION_OUTSIDE.store(false, Ordering::SeqCst);
    assert_eq!(proxy.cuts(), 1, "the failed commit's reply was cut");
    assert!(
        matches!(failed, Err(Error::Database { .. })),
        "resolved as absent, run again, refused by the database: {failed:?}"
    );
    assert_eq!(stored_n(&db.db).await, 1, "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_incarnation_table_writes_keep_their_markers() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let Some(db) = databases::postgres("evidence_no_table").await else {
        return;
    };
    items_table(&db).await;
    db.db
        .execute_unprepared("DROP TABLE freshlock_incarnation")
        .await
        .unwrap();
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let proxied = through(&proxy, &db).await;
    let items = Session::new(proxied).repository::<item::Entity>();
    for round in 1..=10 {
        if round % 3 == 0 {
            proxy.cut_once();
        }
        let report = items
            .locked_update(1, move |i| {
                i.n = Set(round);
                Ok(())
            })
            .await
            .unwrap();
        assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
    }
    assert_eq!(
        proxy.cuts(),
        3,
        "three commit replies were cut, each resolved"
    );
    assert_eq!(markers(&db.db).await, 10, "a marker per write");
    assert_eq!(stored_n(&db.db).await, 10);
}
