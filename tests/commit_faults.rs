//! Lost replies and killed connections never apply a write twice, nor lose an acknowledged one.
//!
//! 8 tasks × 50 locked increments of one row go through a TCP proxy that cuts the connection
//! right after forwarding every 20th `COMMIT` (the server commits, the client never hears), or
//! right after every 10th locked reload; or, without the proxy, a killer ends the test's
//! database sessions every few milliseconds (`pg_terminate_backend`, MariaDB `KILL`). Every call
//! is counted and the row is checked: acknowledged increments = the counter, exactly.
//! PostgreSQL and MariaDB (the shared servers: only this test's own connections are cut or
//! killed), with every backend that applies.

mod common;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use entity::node;
use freshlock::{Error, LockKind, LockPolicy, OnLockFailure, Session};
use proxy::{CutAfter, Proxy};
use sea_orm::{ConnectionTrait, DbBackend, Set, Statement};
use servers::{TestDb, databases};
use tokio::sync::Barrier;

const TASKS: u32 = 8;
const ROUNDS: u32 = 50;
const RELOAD_ROUNDS: u32 = 15;

/// How the storm writes: its lock backend, and whether `locked_update` goes in two flights
/// (`SessionBuilder::two_flights`).
#[derive(Clone, Copy, Debug)]
struct How {
    kind: LockKind,
    two_flights: bool,
}

impl From<LockKind> for How {
    fn from(kind: LockKind) -> Self {
        Self {
            kind,
            two_flights: false,
        }
    }
}

/// `local`, each write in two flights.
const TWO_FLIGHTS: How = How {
    kind: LockKind::Local,
    two_flights: true,
};

/// `pg_advisory`, each write in two flights (the lock tried by the reload).
const TWO_FLIGHTS_ADVISORY: How = How {
    kind: LockKind::PgAdvisory,
    two_flights: true,
};

/// `row`, each write in two flights (the lock row tried by the reload).
const TWO_FLIGHTS_ROW: How = How {
    kind: LockKind::Row,
    two_flights: true,
};

#[derive(Debug, Default)]
struct Tally {
    acknowledged: AtomicU32,
    unknown: AtomicU32,
    failed: AtomicU32,
}

/// 8 tasks × `rounds` increments of node 1 through `db`; returns the tally.
async fn storm(db: &freshlock::Db, url: &str, how: How, markers: bool, rounds: u32) -> Arc<Tally> {
    let kind = how.kind;
    let redis = servers::url(servers::REDIS);
    let backend = kind.connect(db, url, redis.as_deref()).await.unwrap();
    let tally = Arc::new(Tally::default());
    let start = Arc::new(Barrier::new(TASKS as usize));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let session = Session::builder(db)
                .lock(Arc::clone(&backend))
                .policy(
                    LockPolicy::default()
                        .with_lock_tries(1)
                        .with_wait_per_try(Duration::from_secs(60))
                        .with_ttl(Duration::from_secs(2))
                        .with_write_attempts(20)
                        .with_on_failure(OnLockFailure::Proceed),
                )
                .commit_markers(markers)
                .two_flights(how.two_flights)
                .build()
                .unwrap();
            let (tally, start) = (Arc::clone(&tally), Arc::clone(&start));
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                start.wait().await;
                for _ in 0..rounds {
                    let call = nodes.locked_update(1, |n| {
                        let score = n.score.as_ref().unwrap_or(0);
                        n.score = Set(Some(score + 1));
                        Ok(())
                    });
                    let result = tokio::time::timeout(Duration::from_secs(120), call)
                        .await
                        .expect("no call hangs");
                    match result {
                        Ok(report) => {
                            assert!(report.outcome.is_updated(), "{:?}", report.outcome);
                            tally.acknowledged.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(Error::CommitUnknown { .. }) => {
                            tally.unknown.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(error) => {
                            eprintln!("reported failure: {error:?}");
                            tally.failed.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    tally
}

fn counts(tally: &Tally) -> (u32, u32, u32) {
    (
        tally.acknowledged.load(Ordering::SeqCst),
        tally.unknown.load(Ordering::SeqCst),
        tally.failed.load(Ordering::SeqCst),
    )
}

/// A pool through `proxy` to the test's database. `uncached`: without a statement cache, every
/// statement's text crosses the proxy each time (a cached prepared statement is sent by name
/// only), so the proxy can recognize the reload. (On MariaDB that costs ~170 ms per call, so
/// only the reload test asks for it.)
async fn through(proxy: &Proxy, db: &TestDb, uncached: bool) -> (freshlock::Db, String) {
    let url = proxy.url(&db.url);
    let mut options = sea_orm::ConnectOptions::new(&url);
    options
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    if let Some(schema) = &db.schema {
        options
            .set_schema_search_path(schema)
            .set_application_name(schema);
    }
    if uncached {
        #[cfg(feature = "postgres")]
        options.map_sqlx_postgres_opts(|o| o.statement_cache_capacity(0));
        #[cfg(feature = "mysql")]
        options.map_sqlx_mysql_opts(|o| o.statement_cache_capacity(0));
    }
    #[cfg(feature = "postgres")]
    if freshlock::transaction_pooler::is_adopted(&db.handle) {
        let pool = freshlock::transaction_pooler::connect(options)
            .await
            .expect("connect through the proxy and the pooler");
        return (pool, url);
    }
    let pool = sea_orm::Database::connect(options).await.expect("connect");
    (freshlock::Db::new(pool), url)
}

/// Every 20th COMMIT's reply is lost: each one is resolved by its marker, so every call is
/// acknowledged exactly once and the counter equals the acknowledgements.
async fn lost_commit_replies(db: Option<TestDb>, how: impl Into<How>) {
    let Some(db) = db else { return };
    let how = how.into();
    let kind = how.kind;
    if kind == LockKind::Redis && servers::url(servers::REDIS).is_none() {
        return;
    }
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let (proxied, url) = through(&proxy, &db, false).await;
    proxy.cut_every(20);
    let tally = storm(&proxied, &url, how, true, ROUNDS).await;
    let (acknowledged, unknown, failed) = counts(&tally);
    let counter = db.score(1).await.unwrap_or(0) as u32;
    eprintln!(
        "{kind}: {} commit replies cut; {acknowledged} acknowledged, {unknown} unknown, \
         {failed} failed; counter {counter}",
        proxy.cuts()
    );
    assert!(proxy.cuts() >= 5, "the proxy cut commit replies");
    assert_eq!(
        counter, acknowledged,
        "{kind}: none lost, none applied twice"
    );
    assert_eq!(unknown, 0, "every lost reply was resolved");
    assert_eq!(acknowledged + failed, TASKS * ROUNDS);
}

/// Without markers a lost reply is reported as unknown, never run again: the counter holds
/// every acknowledged increment and at most the unknown ones besides.
async fn lost_commit_replies_without_markers(db: Option<TestDb>, how: impl Into<How>) {
    let Some(db) = db else { return };
    let how = how.into();
    let kind = how.kind;
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let (proxied, url) = through(&proxy, &db, false).await;
    proxy.cut_every(20);
    let tally = storm(&proxied, &url, how, false, ROUNDS).await;
    let (acknowledged, unknown, failed) = counts(&tally);
    let counter = db.score(1).await.unwrap_or(0) as u32;
    eprintln!(
        "{kind} without markers: {} cut; {acknowledged} acknowledged, {unknown} unknown, \
         {failed} failed; counter {counter}",
        proxy.cuts()
    );
    assert!(unknown > 0, "lost replies are reported as unknown");
    assert!(
        acknowledged <= counter && counter <= acknowledged + unknown,
        "{counter} outside [{acknowledged}, {}]",
        acknowledged + unknown
    );
}

/// Every 10th locked reload loses its connection: the transaction never reached its commit, so
/// the call runs again, and every call is acknowledged once.
async fn lost_reloads(db: Option<TestDb>, how: impl Into<How>) {
    let Some(db) = db else { return };
    let how = how.into();
    let kind = how.kind;
    db.seed_nodes(1).await;
    // In two flights on PostgreSQL the reload is `EXECUTE` of a statement prepared on the
    // connection (its text crosses once): its message is known by its `BEGIN`.
    let postgres = db.db.get_database_backend() == sea_orm::DbBackend::Postgres;
    let cut = match how.two_flights && postgres {
        true => CutAfter::Begin,
        false => CutAfter::Reload,
    };
    let proxy = Proxy::start(proxy::target(&db.url), cut).await;
    let (proxied, url) = through(&proxy, &db, true).await;
    proxy.cut_every(10);
    // Uncached statements make every MariaDB call slow here: fewer rounds.
    let tally = storm(&proxied, &url, how, true, RELOAD_ROUNDS).await;
    let (acknowledged, unknown, failed) = counts(&tally);
    let counter = db.score(1).await.unwrap_or(0) as u32;
    eprintln!(
        "{kind} reloads cut: {} cut; {acknowledged} acknowledged, {unknown} unknown, {failed} \
         failed; counter {counter}",
        proxy.cuts()
    );
    assert!(proxy.cuts() >= 5);
    assert_eq!((counter, unknown), (acknowledged, 0));
    assert_eq!(acknowledged + failed, TASKS * RELOAD_ROUNDS);
}

/// A killer ends this test's database sessions every 20 ms while the storm runs: a kill may land
/// anywhere, the commit included. Nothing acknowledged is lost or applied twice.
async fn killed_backends(db: Option<TestDb>, how: impl Into<How>) {
    let Some(db) = db else { return };
    let how = how.into();
    let kind = how.kind;
    if kind == LockKind::Redis && servers::url(servers::REDIS).is_none() {
        return;
    }
    db.seed_nodes(1).await;
    let backend = db.db.get_database_backend();
    let direct = db.direct_url();
    let killing = match backend {
        // Behind the pooler: the pooler's server connections to the test's own database, killed
        // under it (a backend crash seen from the pooler).
        DbBackend::Postgres if direct.is_some() => "SELECT pg_terminate_backend(pid) AS killed \
             FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()"
            .to_owned(),
        // The test's connections carry its schema as their application name.
        DbBackend::Postgres => format!(
            "SELECT pg_terminate_backend(pid) AS killed FROM pg_stat_activity \
             WHERE application_name = '{}' AND pid <> pg_backend_pid()",
            db.schema.as_deref().unwrap_or_default()
        ),
        _ => {
            let name = db.url.rsplit('/').next().unwrap_or_default().to_owned();
            format!(
                "SELECT id FROM information_schema.processlist \
                 WHERE db = '{name}' AND id <> CONNECTION_ID()"
            )
        }
    };
    // The killer's own connection, outside the test's pool.
    let killer_db = servers::connect(direct.as_deref().unwrap_or(&db.url), None, 1).await;
    let (stop, kills) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU32::new(0)),
    );
    let killer = {
        let (stop, kills) = (Arc::clone(&stop), Arc::clone(&kills));
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let found = killer_db
                    .query_all_raw(Statement::from_string(backend, killing.clone()))
                    .await
                    .expect("list the test's sessions");
                for row in found {
                    if backend == DbBackend::MySql {
                        let id: i64 = row.try_get("", "id").expect("a session id");
                        let sql = format!("KILL CONNECTION {id}");
                        if killer_db.execute_unprepared(&sql).await.is_ok() {
                            kills.fetch_add(1, Ordering::SeqCst);
                        }
                    } else {
                        kills.fetch_add(1, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let tally = storm(&db.handle, &db.url, how, true, ROUNDS).await;
    stop.store(true, Ordering::SeqCst);
    killer.await.unwrap();
    let (acknowledged, unknown, failed) = counts(&tally);
    let counter = db.score(1).await.unwrap_or(0) as u32;
    eprintln!(
        "{kind}: {} sessions killed; {acknowledged} acknowledged, {unknown} unknown, {failed} \
         failed; counter {counter}",
        kills.load(Ordering::SeqCst)
    );
    assert!(kills.load(Ordering::SeqCst) > 0, "the killer killed");
    assert!(
        acknowledged <= counter && counter <= acknowledged + unknown,
        "{kind}: counter {counter} outside [{acknowledged}, {}]",
        acknowledged + unknown
    );
    assert_eq!(acknowledged + unknown + failed, TASKS * ROUNDS);
}

const JOBS: u32 = 40;
const CLAIM_WORKERS: u32 = 4;

/// Four workers claim and finish 40 jobs through a proxy that loses every 7th `COMMIT` reply
/// (claims and finishes alike). A lost claim commit that happened is resolved as `Claimed` (not
/// left held by a token nobody knows until its lease runs out), a lost finish commit that
/// happened as `Finished` (not `Stale`): every job ends done, finished exactly once, and every
/// acknowledged finish is a done row.
async fn lost_claim_commit_replies(db: Option<TestDb>, markers: bool) {
    let Some(db) = db else { return };
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let (proxied, _) = through(&proxy, &db, false).await;
    proxy.cut_every(7);
    let finished = Arc::new(AtomicU32::new(0));
    let unknown = Arc::new(AtomicU32::new(0));
    let start = Arc::new(Barrier::new(CLAIM_WORKERS as usize));
    let workers: Vec<_> = (0..CLAIM_WORKERS)
        .map(|w| {
            let claims = freshlock::claim::Claims::new(&proxied)
                .commit_markers(markers)
                .with_label(format!("worker {w}"));
            let (finished, unknown, start) = (
                Arc::clone(&finished),
                Arc::clone(&unknown),
                Arc::clone(&start),
            );
            tokio::spawn(async move {
                start.wait().await;
                // Jobs in a different order per worker, so claims collide.
                let mut open: Vec<u32> = (0..JOBS).map(|j| (j + w * 10) % JOBS).collect();
                // Without markers a lost claim reply strands its job for the 60 s lease: give up
                // on it sooner.
                let within = Duration::from_secs(if markers { 30 } else { 6 });
                let deadline = tokio::time::Instant::now() + within;
                while !open.is_empty() && tokio::time::Instant::now() < deadline {
                    let job = open[0];
                    let key = freshlock::lock::LockName::new(format!("job:{job}")).unwrap();
                    match claims.claim(&key, Duration::from_secs(60)).await {
                        Ok(freshlock::claim::ClaimOutcome::Claimed(claim)) => loop {
                            match claims.finish(&claim).await {
                                Ok(freshlock::claim::FinishOutcome::Finished) => {
                                    finished.fetch_add(1, Ordering::SeqCst);
                                    open.remove(0);
                                    break;
                                }
                                Ok(outcome) => panic!("job {job}: our own claim was {outcome:?}"),
                                Err(Error::CommitUnknown { .. }) => {
                                    unknown.fetch_add(1, Ordering::SeqCst);
                                    open.remove(0);
                                    break;
                                }
                                Err(e) if e.is_transient() => continue,
                                Err(e) => panic!("job {job}: {e}"),
                            }
                        },
                        Ok(freshlock::claim::ClaimOutcome::Done) => {
                            open.remove(0);
                        }
                        // Claimed by a live claim: look at it again after the others.
                        Ok(_) => open.rotate_left(1),
                        Err(Error::CommitUnknown { .. }) => {
                            unknown.fetch_add(1, Ordering::SeqCst);
                            open.rotate_left(1);
                        }
                        Err(e) if e.is_transient() => {}
                        Err(e) => panic!("job {job}: {e}"),
                    }
                }
                open.len()
            })
        })
        .collect();
    let mut stranded = 0;
    for worker in workers {
        stranded += worker.await.unwrap();
    }
    let done: i64 = db
        .query_one("SELECT COUNT(*) AS n FROM freshlock_claim WHERE state = 'done'")
        .await
        .try_get("", "n")
        .unwrap();
    let (finished, unknown) = (
        finished.load(Ordering::SeqCst),
        unknown.load(Ordering::SeqCst),
    );
    eprintln!(
        "claims (markers {markers}): {} commit replies cut; {finished} finished, {unknown} \
         unknown, {done} done rows, {stranded} jobs left open by some worker",
        proxy.cuts()
    );
    assert!(proxy.cuts() >= 5, "the proxy cut commit replies");
    if markers {
        assert_eq!(unknown, 0, "every lost reply was resolved");
        assert_eq!(stranded, 0, "no job was left claimed by a lost token");
        assert_eq!(
            (done, finished),
            (i64::from(JOBS), JOBS),
            "each job finished exactly once"
        );
    } else {
        assert!(
            unknown > 0,
            "without markers a lost reply is reported as unknown"
        );
        assert!(
            i64::from(finished) <= done,
            "every acknowledged finish is a done row"
        );
    }
}

servers::server_tests! {
    claims_commit_cut_postgres: lost_claim_commit_replies, true, postgres;
    claims_commit_cut_mysql: lost_claim_commit_replies, true, mysql;
    claims_unmarked_commit_cut_postgres: lost_claim_commit_replies, false, postgres;
}

servers::server_tests! {
    commit_cut_local_postgres: lost_commit_replies, LockKind::Local, postgres;
    commit_cut_table_postgres: lost_commit_replies, LockKind::Table, postgres;
    commit_cut_row_postgres: lost_commit_replies, LockKind::Row, postgres;
    commit_cut_pg_advisory_postgres: lost_commit_replies, LockKind::PgAdvisory, postgres;
    commit_cut_local_mysql: lost_commit_replies, LockKind::Local, mysql;
    commit_cut_table_mysql: lost_commit_replies, LockKind::Table, mysql;
    commit_cut_row_mysql: lost_commit_replies, LockKind::Row, mysql;
    commit_cut_mysql_named_mysql: lost_commit_replies, LockKind::MySqlNamed, mysql;
    unmarked_local_postgres: lost_commit_replies_without_markers, LockKind::Local, postgres;
    commit_cut_two_flights_postgres: lost_commit_replies, TWO_FLIGHTS, postgres;
    unmarked_two_flights_postgres: lost_commit_replies_without_markers, TWO_FLIGHTS, postgres;
    reload_cut_two_flights_postgres: lost_reloads, TWO_FLIGHTS, postgres;
    killed_two_flights_postgres: killed_backends, TWO_FLIGHTS, postgres;
    commit_cut_two_flights_pg_advisory_postgres: lost_commit_replies, TWO_FLIGHTS_ADVISORY, postgres;
    commit_cut_two_flights_row_postgres: lost_commit_replies, TWO_FLIGHTS_ROW, postgres;
    killed_two_flights_pg_advisory_postgres: killed_backends, TWO_FLIGHTS_ADVISORY, postgres;
    commit_cut_two_flights_mysql: lost_commit_replies, TWO_FLIGHTS, mysql;
    commit_cut_two_flights_row_mysql: lost_commit_replies, TWO_FLIGHTS_ROW, mysql;
    unmarked_two_flights_mysql: lost_commit_replies_without_markers, TWO_FLIGHTS, mysql;
    reload_cut_two_flights_mysql: lost_reloads, TWO_FLIGHTS, mysql;
    killed_two_flights_mysql: killed_backends, TWO_FLIGHTS, mysql;
    unmarked_local_mysql: lost_commit_replies_without_markers, LockKind::Local, mysql;
    reload_cut_local_postgres: lost_reloads, LockKind::Local, postgres;
    reload_cut_local_mysql: lost_reloads, LockKind::Local, mysql;
    killed_local_postgres: killed_backends, LockKind::Local, postgres;
    killed_pg_advisory_postgres: killed_backends, LockKind::PgAdvisory, postgres;
    killed_row_postgres: killed_backends, LockKind::Row, postgres;
    killed_local_mysql: killed_backends, LockKind::Local, mysql;
    killed_table_mysql: killed_backends, LockKind::Table, mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    commit_cut_redis_postgres: lost_commit_replies, LockKind::Redis, postgres;
}
