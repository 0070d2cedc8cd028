//! Lock rows do not pile up, and fences never go back.
//!
//! - `locked_update`s of keys that do not exist leave no row in `freshlock_lock` (lease rows,
//!   fence counters) or `freshlock_row_lock`; a key that exists keeps its row (its fences are
//!   history).
//! - `inspect::compact` deletes idle rows nobody holds and raises the fence floor: a name's next
//!   fence is above every fence it had, held leases are untouched.
//! - Under a storm of grants with a compactor deleting rows between them, every name's fences
//!   strictly grow in grant order.
//!
//! SQLite, PostgreSQL and MariaDB, with every backend that keeps rows.

#[path = "common/servers.rs"]
mod servers;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use entity::node;
use freshlock::lock::LockName;
use freshlock::lock::backend::LockGuard;
use freshlock::{LockBackend, LockKind, Session, UpdateOutcome, inspect};
use sea_orm::{ConnectionTrait, DatabaseConnection, Set, Statement};
use servers::{TestDb, databases};
use tokio::sync::Barrier;

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.db
        .query_one_raw(Statement::from_string(db.db.get_database_backend(), sql))
        .await
        .unwrap()
        .unwrap()
        .try_get::<i64>("", "n")
        .unwrap()
}

/// Rows of `freshlock_lock` other than the fence floor.
async fn lock_rows(db: &TestDb) -> i64 {
    count(
        db,
        "SELECT COUNT(*) AS n FROM freshlock_lock WHERE name <> ''",
    )
    .await
}

async fn row_lock_rows(db: &TestDb) -> i64 {
    count(db, "SELECT COUNT(*) AS n FROM freshlock_row_lock").await
}

async fn backend(db: &TestDb, kind: LockKind) -> Option<Arc<dyn LockBackend>> {
    let redis = std::env::var(servers::REDIS).ok();
    if kind == LockKind::Redis && servers::url(servers::REDIS).is_none() {
        return None;
    }
    Some(
        kind.connect(&db.db, &db.url, redis.as_deref())
            .await
            .unwrap(),
    )
}

/// 200 missing keys, and one missing key 20 times: no rows. Then a key that exists: its row
/// stays.
async fn missing_keys_leave_no_rows(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let Some(backend) = backend(&db, kind).await else {
        return;
    };
    db.seed_nodes(1).await;
    let session = Session::builder(db.db.clone())
        .lock(backend)
        .build()
        .unwrap();
    let nodes = session.repository::<node::Entity>();
    let missing = (1_000..1_200).chain(std::iter::repeat_n(5_000, 20));
    for id in missing {
        let report = nodes
            .locked_update(id, |n| {
                n.score = Set(Some(1));
                Ok(())
            })
            .await
            .unwrap();
        assert!(matches!(report.outcome, UpdateOutcome::NotFound), "{id}");
        assert!(report.lock.held, "{id}: {:?}", report.lock);
    }
    assert_eq!(
        (lock_rows(&db).await, row_lock_rows(&db).await),
        (0, 0),
        "{kind}: keys that do not exist leave no lock rows"
    );

    let report = nodes
        .locked_update(1, |n| {
            n.score = Set(Some(1));
            Ok(())
        })
        .await
        .unwrap();
    assert!(report.outcome.is_updated());
    let sqlite = db.db.get_database_backend() == sea_orm::DbBackend::Sqlite;
    let expected = match kind {
        // The row backend's rows live in `freshlock_row_lock` (none on SQLite, which locks the
        // whole database instead).
        LockKind::Row => (0, i64::from(!sqlite)),
        _ => (1, 0),
    };
    assert_eq!(
        (lock_rows(&db).await, row_lock_rows(&db).await),
        expected,
        "{kind}: a key that exists keeps its row"
    );
}

fn lock_name(db: &TestDb, key: &str) -> LockName {
    // Redis keys and MySQL named locks are shared by parallel tests: a prefix of our own.
    let tag = db.schema.clone().unwrap_or_else(|| {
        db.url
            .rsplit(['/', '\\'])
            .next()
            .unwrap_or_default()
            .to_owned()
    });
    LockName::new(format!("{tag}/{key}")).unwrap()
}

async fn grant(backend: &Arc<dyn LockBackend>, db: &DatabaseConnection, name: &LockName) -> u64 {
    let guard = backend
        .acquire(name, Duration::from_secs(10), Duration::from_secs(30))
        .await
        .unwrap()
        .expect("granted");
    let fence = checked_fence(guard.as_ref(), db).await;
    guard.release().await.unwrap();
    fence
}

/// The fence of a write under `guard`: the grant's, or when it has none yet (`mysql_named`
/// issues its fences in the transactions it checks), that of a checked transaction that commits.
async fn checked_fence(guard: &dyn LockGuard, db: &DatabaseConnection) -> u64 {
    if let Some(fence) = guard.fence().filter(|&fence| fence > 0) {
        return fence;
    }
    let txn = sea_orm::TransactionTrait::begin(db).await.unwrap();
    assert!(guard.verify(&txn).await.unwrap(), "still held");
    txn.commit().await.unwrap();
    guard.fence().expect("a fence")
}

/// Compaction deletes idle rows nobody holds, raises the floor past their fences, and keeps held
/// leases and recently granted rows.
async fn compaction_keeps_fences_growing(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let Some(backend) = backend(&db, kind).await else {
        return;
    };
    let (a, b) = (lock_name(&db, "a"), lock_name(&db, "b"));
    let mut last = 0;
    for _ in 0..5 {
        last = grant(&backend, &db.db, &a).await;
    }
    assert!(last >= 5);
    // Recently granted rows survive a compaction that asks for an hour of idleness.
    let kept = inspect::compact(&db.db, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!((kept.lock_rows, lock_rows(&db).await), (0, 1));

    let held = backend
        .acquire(&b, Duration::from_secs(10), Duration::from_secs(30))
        .await
        .unwrap()
        .expect("granted");
    let compacted = inspect::compact(&db.db, Duration::ZERO).await.unwrap();
    let expected_deleted = match kind {
        // `b`'s lease is held (`table`), or its grant wrote no row (`mysql_named`: its fence
        // comes with its first checked transaction): only `a` goes.
        LockKind::Table | LockKind::MySqlNamed => 1,
        // Fence counters carry no holder: `b`'s was granted just now, but idle 0 takes it too,
        // and `b`'s holder then loses its lease (reported, nothing written).
        _ => 2,
    };
    assert_eq!(compacted.lock_rows, expected_deleted, "{kind}");
    assert!(compacted.floor >= last as i64, "{compacted:?} vs {last}");
    if kind == LockKind::Table {
        assert_eq!(lock_rows(&db).await, 1, "the held lease stays");
        let txn = sea_orm::TransactionTrait::begin(&db.db).await.unwrap();
        assert!(held.verify(&txn).await.unwrap(), "and is still valid");
        txn.rollback().await.unwrap();
    }
    held.release().await.unwrap();

    let next = grant(&backend, &db.db, &a).await;
    assert!(
        next > last,
        "{kind}: fence {next} after compaction, {last} before"
    );
    assert!(next as i64 > compacted.floor);
}

const TASKS: usize = 6;
const GRANTS: usize = 60;
const NAMES: usize = 3;

/// 6 tasks × 60 grants over 3 names while a compactor deletes every free row (idle 0) as fast as
/// it can: each name's fences strictly grow in grant order.
async fn fences_grow_under_compaction(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let Some(backend) = backend(&db, kind).await else {
        return;
    };
    let names: Vec<_> = (0..NAMES)
        .map(|i| lock_name(&db, &format!("hot{i}")))
        .collect();
    let seen: Arc<Mutex<HashMap<LockName, Vec<u64>>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let deleted = Arc::new(AtomicU64::new(0));
    let compactor = {
        let (db, stop, deleted) = (db.db.clone(), Arc::clone(&stop), Arc::clone(&deleted));
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let done = inspect::compact(&db, Duration::ZERO).await.unwrap();
                deleted.fetch_add(done.lock_rows, Ordering::SeqCst);
                tokio::task::yield_now().await;
            }
        })
    };
    let start = Arc::new(Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (backend, db, names, seen, start) = (
                Arc::clone(&backend),
                db.db.clone(),
                names.clone(),
                Arc::clone(&seen),
                Arc::clone(&start),
            );
            tokio::spawn(async move {
                start.wait().await;
                for g in 0..GRANTS {
                    let name = &names[(t + g) % NAMES];
                    let guard = backend
                        .acquire(name, Duration::from_secs(30), Duration::from_secs(30))
                        .await
                        .unwrap()
                        .expect("granted");
                    // Recorded while held: the order of the pushes is the order of the grants.
                    let fence = checked_fence(guard.as_ref(), &db).await;
                    seen.lock()
                        .unwrap()
                        .entry(name.clone())
                        .or_default()
                        .push(fence);
                    guard.release().await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    compactor.await.unwrap();
    let seen = seen.lock().unwrap();
    for (name, fences) in seen.iter() {
        assert!(
            fences.windows(2).all(|w| w[0] < w[1]),
            "{kind}: fences of {name} went back: {fences:?}"
        );
    }
    let grants: usize = seen.values().map(Vec::len).sum();
    let deleted = deleted.load(Ordering::SeqCst);
    eprintln!("{kind}: {grants} grants, {deleted} rows deleted by the compactor meanwhile");
    assert_eq!(grants, TASKS * GRANTS);
    assert!(deleted > 0, "the compactor deleted rows between grants");
}

/// The `row` backend while its lock rows are deleted: a section whose row vanished while it
/// waited creates it again, and no increment is lost.
async fn row_locks_survive_compaction(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    db.seed_nodes(3).await;
    let backend = backend(&db, LockKind::Row).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let compactor = {
        let (db, stop) = (db.db.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut deleted = 0;
            while !stop.load(Ordering::SeqCst) {
                deleted += inspect::compact(&db, Duration::ZERO)
                    .await
                    .unwrap()
                    .row_lock_rows;
                tokio::task::yield_now().await;
            }
            deleted
        })
    };
    let start = Arc::new(Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let session = Session::builder(db.db.clone())
                .lock(Arc::clone(&backend))
                .build()
                .unwrap();
            let start = Arc::clone(&start);
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                start.wait().await;
                for g in 0..GRANTS {
                    let id = ((t + g) % 3) as i32 + 1;
                    let report = nodes
                        .locked_update(id, |n| {
                            let score = n.score.as_ref().unwrap_or(0);
                            n.score = Set(Some(score + 1));
                            Ok(())
                        })
                        .await
                        .unwrap();
                    assert!(report.outcome.is_updated() && report.lock.held);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let deleted = compactor.await.unwrap();
    let mut total = 0;
    for id in 1..=3 {
        total += db.score(id).await.unwrap_or(0);
    }
    eprintln!("row: {deleted} lock rows deleted meanwhile; counter {total}");
    assert_eq!(total as usize, TASKS * GRANTS, "no increment lost");
    assert!(deleted > 0);
}

servers::server_tests! {
    missing_table_sqlite: missing_keys_leave_no_rows, LockKind::Table, sqlite;
    missing_table_postgres: missing_keys_leave_no_rows, LockKind::Table, postgres;
    missing_table_mysql: missing_keys_leave_no_rows, LockKind::Table, mysql;
    missing_row_postgres: missing_keys_leave_no_rows, LockKind::Row, postgres;
    missing_row_mysql: missing_keys_leave_no_rows, LockKind::Row, mysql;
    missing_mysql_named_mysql: missing_keys_leave_no_rows, LockKind::MySqlNamed, mysql;
    compact_table_sqlite: compaction_keeps_fences_growing, LockKind::Table, sqlite;
    compact_table_postgres: compaction_keeps_fences_growing, LockKind::Table, postgres;
    compact_table_mysql: compaction_keeps_fences_growing, LockKind::Table, mysql;
    compact_mysql_named_mysql: compaction_keeps_fences_growing, LockKind::MySqlNamed, mysql;
    storm_table_sqlite: fences_grow_under_compaction, LockKind::Table, sqlite;
    storm_table_postgres: fences_grow_under_compaction, LockKind::Table, postgres;
    storm_table_mysql: fences_grow_under_compaction, LockKind::Table, mysql;
    storm_mysql_named_mysql: fences_grow_under_compaction, LockKind::MySqlNamed, mysql;
    row_compaction_postgres: row_locks_survive_compaction, (), postgres;
    row_compaction_mysql: row_locks_survive_compaction, (), mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    missing_redis_postgres: missing_keys_leave_no_rows, LockKind::Redis, postgres;
    compact_redis_postgres: compaction_keeps_fences_growing, LockKind::Redis, postgres;
    storm_redis_mysql: fences_grow_under_compaction, LockKind::Redis, mysql;
}
