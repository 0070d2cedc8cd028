//! Names that differ only by case, accent or trailing spaces are different names: for leases,
//! fences and claims, on SQLite, PostgreSQL and MariaDB (whose default collation would merge
//! them).

#[path = "common/servers.rs"]
mod servers;

use std::time::Duration;

use freshlock::LockKind;
use freshlock::claim::{ClaimOutcome, Claims};
use freshlock::lock::backend::LeaseLock;
use freshlock::lock::{LockName, TableLock};
use sea_orm::TransactionTrait;
use servers::{TestDb, databases};

const NAMES: [&str; 4] = ["job:e", "job:E", "job:é", "job:e  "];

/// The four names, under a prefix of this test's own (Redis keys are shared by parallel tests).
fn names(db: &TestDb) -> Vec<String> {
    let tag = db.schema.clone().unwrap_or_else(|| {
        db.url
            .rsplit(['/', '\\'])
            .next()
            .unwrap_or_default()
            .to_owned()
    });
    NAMES.iter().map(|n| format!("{tag}/{n}")).collect()
}

fn name(s: &str) -> LockName {
    LockName::new(s).unwrap()
}

async fn distinct_names(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    let names = names(&db);

    // Claims: finishing one never makes the others `Done`.
    let claims = Claims::new(db.db.clone());
    let ClaimOutcome::Claimed(first) = claims
        .claim(&name(&names[0]), Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("a fresh claim");
    };
    claims.finish(&first).await.unwrap();
    for other in &names[1..] {
        let outcome = claims
            .claim(&name(other), Duration::from_secs(60))
            .await
            .unwrap();
        assert!(
            matches!(outcome, ClaimOutcome::Claimed(ref claim) if claim.fence == 1),
            "{other:?} is its own job: {outcome:?}"
        );
    }

    // Leases: all four held at once, each with its own fence row.
    let leases = TableLock::new(db.db.clone());
    let mut held = Vec::new();
    for each in &names {
        let guard = leases
            .acquire(&name(each), Duration::ZERO, Duration::from_secs(60))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{each:?} is free"));
        assert_eq!(guard.fence(), Some(1), "{each:?} has a fence of its own");
        held.push(guard);
    }
    let txn = db.db.begin().await.unwrap();
    for guard in &held {
        assert!(guard.verify(&txn).await.unwrap(), "still the holder");
    }
    txn.rollback().await.unwrap();
    for guard in held {
        guard.release().await.unwrap();
    }
}

/// Fences of `mysql_named` (and `redis`) live in `freshlock_lock`: a grant of `job:E` must not
/// bump `job:e`'s fence (which would fence out its live holder).
async fn distinct_fences(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let redis = servers::url(servers::REDIS);
    if kind == LockKind::Redis && redis.is_none() {
        return;
    }
    let backend = kind
        .connect(&db.db, &db.url, redis.as_deref())
        .await
        .unwrap();
    let names = names(&db);
    let first = backend
        .acquire(&name(&names[0]), Duration::ZERO, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    for other in &names[1..] {
        let guard = backend
            .acquire(&name(other), Duration::ZERO, Duration::from_secs(60))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{other:?} is free"));
        guard.release().await.unwrap();
    }
    let txn = db.db.begin().await.unwrap();
    assert!(
        first.verify(&txn).await.unwrap(),
        "{kind}: the first holder was not fenced out by other names"
    );
    txn.rollback().await.unwrap();
    first.release().await.unwrap();
}

servers::server_tests! {
    names_sqlite: distinct_names, (), sqlite;
    names_postgres: distinct_names, (), postgres;
    names_mysql: distinct_names, (), mysql;
    fences_mysql_named: distinct_fences, LockKind::MySqlNamed, mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    fences_redis_mysql: distinct_fences, LockKind::Redis, mysql;
    fences_redis_postgres: distinct_fences, LockKind::Redis, postgres;
}
