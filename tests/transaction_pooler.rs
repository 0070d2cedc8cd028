//! PostgreSQL behind PgBouncer in transaction mode (`freshlock::transaction_pooler`).
//!
//! A private PgBouncer 1.18 (`.ci/pgbouncer`, on a free port) in front of the shared server:
//! - an adopted pool: 8 tasks × 25 rounds of `load`, `locked_update` (policy *Proceed*),
//!   `load_many`, `load_fresh` + guarded `save`, for every backend that works on PostgreSQL:
//!   0 failed calls, every call held its lock, and the rows hold exactly the acknowledged writes;
//! - `adopt` refuses a pool with sqlx's statement cache on, and a pooler without
//!   `server_reset_query_always`;
//! - a pool that reaches the pooler without being adopted fails its calls with
//!   `Error::TransactionPooler` — under *Proceed* too — and never writes without its lock.
//!
//! Needs root (PgBouncer runs as `postgres`), `DATABASE_URL_POSTGRES` and the `pgbouncer`
//! package, as `.ci/run` has; skips and says so elsewhere.
#![cfg(feature = "postgres")]

mod common;
#[path = "common/private_pgbouncer.rs"]
mod private_pgbouncer;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use entity::node;
use freshlock::{Error, LockKind, LockPolicy, OnLockFailure, SaveOutcome, Session, UpdateOutcome};
use migration::{Migrator, MigratorTrait};
use private_pgbouncer::PrivatePgBouncer;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, EntityTrait, IntoActiveModel,
    Set,
};
use tokio::sync::Barrier;

const TASKS: u32 = 8;
const ROUNDS: u32 = 25;

/// A fresh database `fl_…` on the shared server, migrated there directly (never through the
/// pooler) and seeded with nodes 1 and 2; returns its name.
async fn database(direct: &str, tag: &str) -> String {
    let name = servers::unique(tag);
    let admin = servers::connect(direct, None, 1).await;
    admin
        .execute_unprepared(&format!("CREATE DATABASE \"{name}\""))
        .await
        .expect("create database");
    admin.close().await.ok();
    let db = servers::connect(&servers::with_database(direct, &name), None, 1).await;
    Migrator::up(&db, None).await.expect("migrate");
    node::Entity::insert_many([node::ActiveModel::fresh(1), node::ActiveModel::fresh(2)])
        .exec(&db)
        .await
        .expect("seed");
    db.close().await.ok();
    name
}

/// The shared server's URL, a private PgBouncer and a fresh database `tag`; `None` to skip.
async fn setup(tag: &str) -> Option<(String, PrivatePgBouncer, String)> {
    let direct = servers::url(servers::POSTGRES)?;
    let pooler = PrivatePgBouncer::start(true)?;
    let name = database(&direct, tag).await;
    Some((direct, pooler, name))
}

fn options(url: &str) -> ConnectOptions {
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    options
}

/// A pool through the pooler as sea-orm makes it (the statement cache on), without the startup
/// parameter PgBouncer 1.18 refuses.
async fn plain(url: &str) -> DatabaseConnection {
    let mut options = options(url);
    options.map_sqlx_postgres_opts(|o| o.extra_float_digits(None));
    Database::connect(options).await.expect("connect")
}

/// Scores of nodes 1 and 2, read on the server directly.
async fn scores(direct: &str, name: &str) -> (i32, i32) {
    let db = servers::connect(&servers::with_database(direct, name), None, 1).await;
    let read = |id| {
        let db = db.clone();
        async move {
            node::Entity::find_by_id(id)
                .one(&db)
                .await
                .expect("read")
                .and_then(|n| n.score)
                .unwrap_or(0)
        }
    };
    let scores = (read(1).await, read(2).await);
    db.close().await.ok();
    scores
}

/// The `apply` of every locked write here: node's score + 1.
fn increment(n: &mut node::ActiveModel) -> Result<(), freshlock::ApplyError> {
    n.score = Set(Some(n.score.as_ref().unwrap_or(0) + 1));
    Ok(())
}

fn proceed() -> LockPolicy {
    LockPolicy::default()
        .with_lock_tries(1)
        .with_wait_per_try(Duration::from_secs(30))
        .with_ttl(Duration::from_secs(30))
        .with_write_attempts(50)
        .with_on_failure(OnLockFailure::Proceed)
}

#[derive(Default)]
struct Tally {
    increments: AtomicU32,
    saves: AtomicU32,
    conflicts: AtomicU32,
    unlocked: AtomicU32,
    failed: AtomicU32,
}

/// The workload through `db` with `kind`; the tally of what was acknowledged.
async fn storm(db: &freshlock::Db, url: &str, kind: LockKind) -> Arc<Tally> {
    let redis = servers::url(servers::REDIS);
    let backend = kind
        .connect(db, url, redis.as_deref())
        .await
        .expect("the backend works behind the pooler");
    let tally = Arc::new(Tally::default());
    let start = Arc::new(Barrier::new(TASKS as usize));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let session = Session::builder(db)
                .lock(Arc::clone(&backend))
                .policy(proceed())
                .build()
                .expect("session");
            let (tally, start) = (Arc::clone(&tally), Arc::clone(&start));
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                start.wait().await;
                for round in 0..ROUNDS {
                    let failed = |what: &str, e: Error| {
                        eprintln!("{kind}: {what} failed: {e:?}");
                        tally.failed.fetch_add(1, Ordering::SeqCst);
                    };
                    if let Err(e) = nodes.load(1).await {
                        failed("load", e);
                    }
                    match nodes.locked_update(1, increment).await {
                        Ok(report) => {
                            assert!(
                                matches!(report.outcome, UpdateOutcome::Updated(_)),
                                "{:?}",
                                report.outcome
                            );
                            if !report.lock.held {
                                tally.unlocked.fetch_add(1, Ordering::SeqCst);
                            }
                            tally.increments.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(e) => failed("locked_update", e),
                    }
                    if round % 5 == 0 {
                        if let Err(e) = nodes.load_many([1, 2]).await {
                            failed("load_many", e);
                        }
                        // A guarded save of node 2 from a fresh snapshot: kept or a conflict.
                        match nodes.load_fresh(2).await {
                            Ok(Some(snapshot)) => {
                                let mut model = (*snapshot).clone().into_active_model();
                                model.score = Set(Some(snapshot.score.unwrap_or(0) + 1));
                                match nodes.save(model).await {
                                    Ok(SaveOutcome::Updated(_)) => {
                                        tally.saves.fetch_add(1, Ordering::SeqCst);
                                    }
                                    Ok(SaveOutcome::Conflict) => {
                                        tally.conflicts.fetch_add(1, Ordering::SeqCst);
                                    }
                                    Ok(other) => panic!("unexpected save outcome {other:?}"),
                                    Err(e) => failed("save", e),
                                }
                            }
                            Ok(None) => panic!("node 2 exists"),
                            Err(e) => failed("load_fresh", e),
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    tally
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_backend_through_pgbouncer() {
    let Some(direct) = servers::url(servers::POSTGRES) else {
        return;
    };
    let Some(pooler) = PrivatePgBouncer::start(true) else {
        return;
    };
    let mut kinds = vec![
        LockKind::Local,
        LockKind::Table,
        LockKind::Row,
        LockKind::PgAdvisory,
    ];
    if servers::url(servers::REDIS).is_some() {
        kinds.push(LockKind::Redis);
    }
    for kind in kinds {
        let name = database(&direct, &format!("pooler_{kind}")).await;
        let url = pooler.url(&name);
        let db = freshlock::transaction_pooler::connect(options(&url))
            .await
            .expect("adopted");
        assert!(freshlock::transaction_pooler::is_adopted(&db));
        assert!(freshlock::transaction_pooler::is_adopted(&db.clone()));
        let tally = storm(&db, &url, kind).await;
        db.connection().clone().close().await.ok();
        let (increments, saves, conflicts, unlocked, failed) = (
            tally.increments.load(Ordering::SeqCst),
            tally.saves.load(Ordering::SeqCst),
            tally.conflicts.load(Ordering::SeqCst),
            tally.unlocked.load(Ordering::SeqCst),
            tally.failed.load(Ordering::SeqCst),
        );
        let (one, two) = scores(&direct, &name).await;
        eprintln!(
            "{kind} through PgBouncer: {increments} increments, {saves} saves ({conflicts} \
             conflicts), {unlocked} unlocked, {failed} failed; rows {one}, {two}"
        );
        assert_eq!(failed, 0, "{kind}: no call failed");
        assert_eq!(unlocked, 0, "{kind}: no call went on without its lock");
        assert_eq!(
            increments,
            TASKS * ROUNDS,
            "{kind}: every increment acknowledged"
        );
        assert_eq!(
            one as u32, increments,
            "{kind}: node 1 holds every increment once"
        );
        assert_eq!(
            two as u32, saves,
            "{kind}: node 2 holds every acknowledged save once"
        );
        assert_eq!(saves + conflicts, TASKS * ROUNDS.div_ceil(5));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adopt_refuses_what_cannot_work() {
    let Some((_, pooler, name)) = setup("pooler_refusals").await else {
        return;
    };
    // sqlx's statement cache on (its default).
    let cached = plain(&pooler.url(&name)).await;
    let cached = freshlock::Db::new(cached);
    match freshlock::transaction_pooler::adopt(&cached).await {
        Err(Error::TransactionPooler { reason, .. }) => {
            assert!(reason.contains("statement cache"), "{reason}");
        }
        other => panic!("a cached pool must be refused, got {other:?}"),
    }
    assert!(!freshlock::transaction_pooler::is_adopted(&cached));
    cached.connection().clone().close().await.ok();

    // A pooler that keeps prepared statements between transactions.
    let Some(keeping) = PrivatePgBouncer::start(false) else {
        return;
    };
    match freshlock::transaction_pooler::connect(options(&keeping.url(&name))).await {
        Err(Error::TransactionPooler { reason, .. }) => {
            assert!(reason.contains("server_reset_query_always"), "{reason}");
        }
        other => panic!("a pooler without the reset must be refused, got {other:?}"),
    }

    // Not PostgreSQL.
    let sqlite = common::memory_db().await;
    assert!(matches!(
        freshlock::transaction_pooler::adopt(&freshlock::Db::new(sqlite)).await,
        Err(Error::TransactionPooler { .. })
    ));
}

/// Through the pooler without `adopt`: calls fail with a clear error, none writes unlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unadopted_pool_never_writes_without_its_lock() {
    let Some((direct, pooler, name)) = setup("pooler_unadopted").await else {
        return;
    };
    let url = pooler.url(&name);
    let db = plain(&url).await;
    // The table lease's own statements run outside the write's transaction.
    let backend = LockKind::Table
        .connect(&db, &url, None)
        .await
        .expect("backend");
    let (ok, unlocked, clashes, other) = (
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
    );
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let session = Session::builder(db.clone())
                .lock(Arc::clone(&backend))
                .policy(proceed().with_write_attempts(1))
                .build()
                .expect("session");
            let (ok, unlocked, clashes, other) = (
                Arc::clone(&ok),
                Arc::clone(&unlocked),
                Arc::clone(&clashes),
                Arc::clone(&other),
            );
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                for _ in 0..10 {
                    match nodes.locked_update(1, increment).await {
                        Ok(report) => {
                            ok.fetch_add(1, Ordering::SeqCst);
                            if !report.lock.held {
                                unlocked.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        Err(Error::TransactionPooler { .. }) => {
                            clashes.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(e) => {
                            eprintln!("other error: {e:?}");
                            other.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    // Adopted after the fact, the same pool is refused: its statement cache is on.
    assert!(
        freshlock::transaction_pooler::adopt(&freshlock::Db::from(&db))
            .await
            .is_err()
    );
    db.close().await.ok();
    let (one, _) = scores(&direct, &name).await;
    let (ok, unlocked, clashes, other) = (
        ok.load(Ordering::SeqCst),
        unlocked.load(Ordering::SeqCst),
        clashes.load(Ordering::SeqCst),
        other.load(Ordering::SeqCst),
    );
    eprintln!(
        "unadopted: {ok} acknowledged, {unlocked} unlocked, {clashes} refused as pooler clashes, \
         {other} other errors; row {one}"
    );
    assert_eq!(unlocked, 0, "no call proceeded without its lock");
    assert!(clashes > 0, "the clash is reported as such");
    assert_eq!(other, 0, "every failure names the pooler");
    assert_eq!(
        one as u32, ok,
        "the row holds exactly the acknowledged writes"
    );
}
