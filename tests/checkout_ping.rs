//! A pool without sqlx's checkout ping (`test_before_acquire(false)`, one round trip less per
//! transaction) loses no locked write to a connection that died while it sat idle in the pool.
//!
//! The server ends every connection of the test's pool (`pg_terminate_backend`, MariaDB
//! `KILL CONNECTION`) while they are idle; the pool does not find out until it hands one out.
//! The next `locked_update`, `locked_update_pair`, section, claim and finish then meet a dead
//! connection at their first statement (`BEGIN`, or a `table` lease's grant): nothing has begun
//! on it, so freshlock tries another connection — as many times as the pool has connections (12
//! here, more than a call's 5 write attempts: spending an attempt per dead connection would fail
//! the call). Each call must come back `Updated` / `Finished` with its lock held (never an
//! error, never an unknown outcome), and the rows must hold exactly the acknowledged
//! increments. `load`, an idempotent read, is tried again the same way. Every backend that
//! applies: `local`, `row`, `table`, `redis` (with `REDIS_URL`; its fence bump begins a
//! transaction of its own), and `pg_advisory` on PostgreSQL.
//!
//! Not covered, by design: `save` and `optimistic_first`'s one-statement write run in
//! autocommit, and a write whose connection breaks may have happened, so it is reported
//! (`Error::CommitUnknown`) rather than sent again; a pool with the ping avoids that case.
//!
//! PostgreSQL and MariaDB (the shared servers; only the test's own connections are ended).

#[path = "common/servers.rs"]
mod servers;

use std::{sync::Arc, time::Duration};

use entity::node;
use freshlock::claim::{ClaimOutcome, Claims, FinishOutcome};
use freshlock::lock::{LocalLock, LockName};
use freshlock::{LockBackend, LockKind, LockPolicy, OnLockFailure, Session, lock_name};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, EntityTrait, Set,
};
use servers::TestDb;

/// The pool's size: more connections than a call has write attempts (5).
const POOL: u32 = 12;

/// The test's pool, like `db`'s but without the checkout ping, kept full.
async fn unpinged(db: &TestDb) -> DatabaseConnection {
    let mut options = ConnectOptions::new(&db.url);
    options
        .max_connections(POOL)
        .min_connections(POOL)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(10))
        .sqlx_logging(false);
    if let Some(schema) = &db.schema {
        options
            .set_schema_search_path(schema)
            .set_application_name(schema);
    }
    Database::connect(options).await.expect("connect")
}

/// Ends every connection of the test's own pool on the server; how many it ended.
async fn end_connections(db: &TestDb, admin: &DatabaseConnection) -> usize {
    match admin.get_database_backend() {
        DbBackend::Postgres => {
            let sql = format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = '{}' AND pid <> pg_backend_pid()",
                db.schema.as_deref().unwrap_or_default()
            );
            admin
                .query_all_raw(statement(&sql))
                .await
                .expect("terminate")
                .len()
        }
        _ => {
            let name = db.url.rsplit('/').next().unwrap_or_default().to_owned();
            let sql = format!(
                "SELECT id FROM information_schema.processlist \
                 WHERE db = '{name}' AND id <> CONNECTION_ID()"
            );
            let ids = admin
                .query_all_raw(statement(&sql))
                .await
                .expect("sessions");
            let mut ended = 0;
            for row in &ids {
                let id: i64 = row.try_get("", "id").expect("a session id");
                match admin
                    .execute_unprepared(&format!("KILL CONNECTION {id}"))
                    .await
                {
                    Ok(_) => ended += 1,
                    // 1094 "Unknown thread id": the session ended between the listing and its
                    // KILL (sqlx closing a connection it found dead); it is gone, as wanted.
                    Err(e) if e.to_string().contains("Unknown thread id") => {}
                    Err(e) => panic!("kill: {e:?}"),
                }
            }
            ended
        }
    }
}

/// Makes the pool hold all its 12 connections again, then ends every one that is alive; how
/// many that was. The pool is filled by taking all its connections at once (it opens those it
/// lacks) and giving them back: sqlx reopens connections it dropped only when it closes one
/// while a permit is free (`try_min_connections` gives up when none is, as while a call takes
/// connection after connection) or when its reaper runs, every 10 minutes here — CI once
/// waited 10 s for a refill that never came.
async fn kill_all(db: &TestDb, admin: &DatabaseConnection, pool: &DatabaseConnection) -> usize {
    let size = match pool.get_database_backend() {
        #[cfg(feature = "postgres")]
        DbBackend::Postgres => fill(pool.get_postgres_connection_pool()).await,
        #[cfg(feature = "mysql")]
        DbBackend::MySql => fill(pool.get_mysql_connection_pool()).await,
        _ => POOL,
    };
    assert_eq!(size, POOL, "the pool holds all its connections");
    // Every connection of the pool is dead now: the live ones are ended, the others died
    // before and were not handed out since (sqlx still counts them).
    end_connections(db, admin).await
}

/// Takes all the connections of `pool` at once (it opens those it lacks) and gives them back:
/// how many it holds then.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn fill<DB: sea_orm::sqlx::Database>(pool: &sea_orm::sqlx::Pool<DB>) -> u32 {
    let mut taken = Vec::new();
    for _ in 0..POOL {
        taken.push(pool.acquire().await.expect("a connection of the pool"));
    }
    drop(taken);
    pool.size()
}

fn statement(sql: &str) -> sea_orm::Statement {
    // Only the backend's placeholder style differs, and these statements have none.
    sea_orm::Statement::from_string(DbBackend::Postgres, sql.to_owned())
}

async fn score(db: &DatabaseConnection, id: i32) -> i32 {
    node::Entity::find_by_id(id)
        .one(db)
        .await
        .expect("read")
        .and_then(|n| n.score)
        .unwrap_or(0)
}

async fn dead_idle_connections_cost_nothing(db: TestDb, kind: LockKind) {
    db.seed_nodes(3).await;
    // Only the test's own pool is left on the database (the admin connection is not ended).
    db.db.clone().close().await.expect("close the setup pool");
    let pool = unpinged(&db).await;
    let admin = servers::connect(&db.url, db.schema.as_deref(), 1).await;
    let lock: Arc<dyn LockBackend> = match kind {
        LockKind::Local => Arc::new(LocalLock::new()),
        kind => {
            let redis = servers::url(servers::REDIS);
            kind.connect(&pool, &db.url, redis.as_deref())
                .await
                .expect("backend")
        }
    };
    // Without the lock a call fails rather than going on unlocked: every call must hold it.
    let session = Session::builder(pool.clone())
        .lock(lock)
        .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
        .build()
        .expect("session");
    let nodes = session.repository::<node::Entity>();
    let (mut acknowledged, mut ended, mut rerun) = ([0; 3], 0, 0);
    for _ in 0..4 {
        // Every connection of the pool dies while idle (more of them than a call has write
        // attempts: a call that spent an attempt per dead connection would fail)…
        ended += kill_all(&db, &admin, &pool).await;
        // …and the next calls still go through.
        let report = nodes
            .locked_update(1, |n| {
                n.score = Set(Some(n.score.as_ref().unwrap_or(0) + 1));
                Ok(())
            })
            .await
            .expect("locked_update on a pool whose connections died idle");
        assert!(report.outcome.is_updated(), "{:?}", report.outcome);
        assert!(report.lock.held, "{kind}: {:?}", report.lock);
        acknowledged[0] += 1;
        rerun += report.attempts - 1;

        ended += kill_all(&db, &admin, &pool).await;
        let many = nodes
            .locked_update_pair(2, 3, |a, b| {
                a.score = Set(Some(a.score.as_ref().unwrap_or(0) + 1));
                b.score = Set(Some(b.score.as_ref().unwrap_or(0) + 1));
                Ok(())
            })
            .await
            .expect("locked_update_pair on a pool whose connections died idle");
        assert!(many.outcomes.iter().all(|o| o.is_updated()), "{many:?}");
        assert!(
            many.locks.iter().all(|l| l.held),
            "{kind}: {:?}",
            many.locks
        );
        acknowledged[1] += 1;
        acknowledged[2] += 1;
        rerun += many.attempts - 1;

        ended += kill_all(&db, &admin, &pool).await;
        let key = lock_name::<node::Entity>(1).expect("name");
        let section = session
            .section([key])
            .run_retrying(|tx| {
                Box::pin(async move {
                    let nodes = tx.repository::<node::Entity>();
                    let found = nodes.load(1).await?.expect("node 1");
                    let mut draft: node::ActiveModel = (*found).clone().into();
                    draft.score = Set(Some(found.score.unwrap_or(0) + 1));
                    nodes.save(draft).await?;
                    Ok(())
                })
            })
            .await
            .expect("a section on a pool whose connections died idle");
        acknowledged[0] += 1;
        rerun += section.attempts - 1;

        ended += kill_all(&db, &admin, &pool).await;
        let claims = Claims::new(pool.clone());
        let job = LockName::new(format!("ping:{kind}:{}", acknowledged[0])).expect("name");
        let ClaimOutcome::Claimed(claim) = claims
            .claim(&job, Duration::from_secs(60))
            .await
            .expect("a claim on a pool whose connections died idle")
        else {
            panic!("a new job is claimed");
        };
        ended += kill_all(&db, &admin, &pool).await;
        let finished = claims
            .finish(&claim)
            .await
            .expect("a finish on a pool whose connections died idle");
        assert_eq!(finished, FinishOutcome::Finished);

        ended += kill_all(&db, &admin, &pool).await;
        nodes.reset_cache_all();
        let loaded = nodes
            .load(1)
            .await
            .expect("load on a pool whose connections died idle");
        assert_eq!(loaded.and_then(|n| n.score), Some(acknowledged[0]));
    }
    assert!(
        ended >= 4,
        "the server ended the pool's connections ({ended})"
    );
    for (i, want) in acknowledged.iter().enumerate() {
        let id = i as i32 + 1;
        assert_eq!(
            score(&admin, id).await,
            *want,
            "node {id}: acknowledged = stored"
        );
    }
    eprintln!(
        "{:?}, {kind}: {ended} connections ended, {rerun} write attempts run again, acknowledged {acknowledged:?}",
        admin.get_database_backend()
    );
}

/// `these`, and `redis` where a Redis URL is set (its fence bump begins a transaction too).
fn kinds(these: &[LockKind]) -> Vec<LockKind> {
    let mut kinds = these.to_vec();
    if cfg!(feature = "redis") && servers::url(servers::REDIS).is_some() {
        kinds.push(LockKind::Redis);
    }
    kinds
}

#[tokio::test]
async fn postgres_dead_idle_connections_cost_nothing() {
    for kind in kinds(&[
        LockKind::Local,
        LockKind::Row,
        LockKind::PgAdvisory,
        LockKind::Table,
    ]) {
        if let Some(db) = servers::postgres("ping").await {
            dead_idle_connections_cost_nothing(db, kind).await;
        }
    }
}

#[tokio::test]
async fn mysql_dead_idle_connections_cost_nothing() {
    for kind in kinds(&[LockKind::Local, LockKind::Row, LockKind::Table]) {
        if let Some(db) = servers::mysql("ping").await {
            dead_idle_connections_cost_nothing(db, kind).await;
        }
    }
}
