//! `Session::with_lock`: a short transaction under a keyed lock, for work that is not one row's
//! update — exclusive on every backend, each task with its own backend instance (so only the
//! backend, not the in-process queue, keeps them apart).

#[path = "common/servers.rs"]
mod servers;

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use entity::ham;
use freshlock::{
    ApplyError, LockKind, LockPolicy, OnLockFailure, SectionOutcome, Session, lock_name,
};
use sea_orm::{EntityTrait, Set};
use servers::{TestDb, databases};

async fn exclusive_sections(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let redis = servers::url(servers::REDIS);
    if kind == LockKind::Redis && redis.is_none() {
        return;
    }
    ham::Entity::insert(ham::ActiveModel {
        id: Set(1),
        name: Set("ham".into()),
        updated_at: Set(0),
    })
    .exec(&db.db)
    .await
    .unwrap();
    let inside = Arc::new(AtomicBool::new(false));
    let key = lock_name::<ham::Entity>(1).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let backend = kind
            .connect(&db.db, &db.url, redis.as_deref())
            .await
            .unwrap();
        let session = Session::builder(db.db.clone())
            .lock(backend)
            .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
            .build()
            .unwrap();
        let (inside, key) = (Arc::clone(&inside), key.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..25 {
                let inside = Arc::clone(&inside);
                let report = session
                    .with_lock(&key, move |txn| {
                        Box::pin(async move {
                            assert!(!inside.swap(true, Ordering::SeqCst), "two sections at once");
                            // A read-modify-write with no row lock: only the keyed lock makes it safe.
                            let ham = ham::Entity::find_by_id(1)
                                .one(txn)
                                .await?
                                .ok_or_else(|| ApplyError::msg("gone"))?;
                            tokio::task::yield_now().await;
                            ham::Entity::update(ham::ActiveModel {
                                id: Set(1),
                                updated_at: Set(ham.updated_at + 1),
                                ..Default::default()
                            })
                            .exec(txn)
                            .await?;
                            inside.store(false, Ordering::SeqCst);
                            Ok(ham.updated_at + 1)
                        })
                    })
                    .await
                    .unwrap();
                assert!(report.lock.held);
                assert!(matches!(report.outcome, SectionOutcome::Committed(_)));
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let ham = ham::Entity::find_by_id(1)
        .one(&db.db)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ham.updated_at, 100, "{kind}: lost updates");
}

servers::server_tests! {
    table_sqlite: exclusive_sections, LockKind::Table, sqlite;
    row_sqlite: exclusive_sections, LockKind::Row, sqlite;
    table_postgres: exclusive_sections, LockKind::Table, postgres;
    row_postgres: exclusive_sections, LockKind::Row, postgres;
    pg_advisory_postgres: exclusive_sections, LockKind::PgAdvisory, postgres;
    table_mysql: exclusive_sections, LockKind::Table, mysql;
    row_mysql: exclusive_sections, LockKind::Row, mysql;
    mysql_named_mysql: exclusive_sections, LockKind::MySqlNamed, mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    redis_postgres: exclusive_sections, LockKind::Redis, postgres;
}
