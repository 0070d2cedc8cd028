//! A silent partition: a TCP proxy forwards a `COMMIT` and then passes nothing more either way,
//! keeping both sockets open (no FIN, no RST), as a firewall or NAT that forgot the connection
//! does. Without a deadline the call waits for TCP keepalive (hours) and its section keeps the
//! row's lock, so every other call on the row waits out the lock policy and goes on without the
//! lock. With [`LockPolicy::reply_timeout`] the commit is in doubt after the bound, resolved by
//! its marker on another connection, and the key serves calls again.
//!
//! 4 tasks × 40 increments of one row, every 25th `COMMIT` black-holed, each backend on
//! PostgreSQL and MariaDB: acknowledged = the counter (± unknown), no call hangs, and no call
//! waited out the lock policy's 30 s behind a frozen key.

mod common;
#[path = "common/proxy.rs"]
mod proxy;
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
use freshlock::{Error, LockKind, LockPolicy, OnLockFailure, Session};
use proxy::{CutAfter, Proxy};
use sea_orm::Set;
use servers::{TestDb, databases};

const TASKS: u32 = 4;
const ROUNDS: u32 = 40;
/// The bound on one reply, far below the lock policy's wait.
const REPLY: Duration = Duration::from_secs(1);
/// The lock policy's wait: what a call behind a frozen key would wait out.
const WAIT: Duration = Duration::from_secs(30);

async fn black_holed_commits(db: Option<TestDb>, kind: LockKind) {
    let Some(db) = db else { return };
    let redis = match kind {
        LockKind::Redis => match servers::url(servers::REDIS) {
            Some(redis) => Some(redis),
            None => return,
        },
        _ => None,
    };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let url = proxy.url(&db.url);
    let mut options = sea_orm::ConnectOptions::new(&url);
    // Each black-holed connection keeps its pool slot (see the library's deadline docs).
    options
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    if let Some(schema) = &db.schema {
        options.set_schema_search_path(schema);
    }
    let proxied = sea_orm::Database::connect(options).await.unwrap();
    let backend = kind
        .connect(&proxied, &url, redis.as_deref())
        .await
        .unwrap();
    proxy.black_hole(true);
    proxy.cut_every(25);

    let (acknowledged, unknown, slowest_ms) = (
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
    );
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let session = Session::builder(proxied.clone())
                .lock(Arc::clone(&backend))
                .policy(
                    LockPolicy::default()
                        .with_lock_tries(1)
                        .with_wait_per_try(WAIT)
                        .with_ttl(Duration::from_secs(30))
                        .with_on_failure(OnLockFailure::Proceed)
                        .with_reply_timeout(REPLY),
                )
                .build()
                .unwrap();
            let (acknowledged, unknown, slowest_ms) = (
                Arc::clone(&acknowledged),
                Arc::clone(&unknown),
                Arc::clone(&slowest_ms),
            );
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                for _ in 0..ROUNDS {
                    let started = tokio::time::Instant::now();
                    let call = nodes.locked_update(1, |n| {
                        let score = n.score.as_ref().unwrap_or(0);
                        n.score = Set(Some(score + 1));
                        Ok(())
                    });
                    let result = tokio::time::timeout(Duration::from_secs(25), call)
                        .await
                        .expect("no call hangs on a black-holed reply");
                    let took = u32::try_from(started.elapsed().as_millis()).unwrap_or(u32::MAX);
                    slowest_ms.fetch_max(took, Ordering::SeqCst);
                    match result {
                        Ok(report) => {
                            assert!(report.outcome.is_updated(), "{:?}", report.outcome);
                            // Held, or refused by a lease grant that itself met the black
                            // hole (redis bumps its fence in the database) after its own bound:
                            // never after waiting out the policy's 30 s behind a frozen key.
                            assert!(
                                report.lock.held || report.lock.waited < WAIT,
                                "a call waited out the lock policy: the key was frozen ({report:?})"
                            );
                            acknowledged.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(Error::CommitUnknown { .. }) => {
                            unknown.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(error) => panic!("{kind}: unexpected failure {error:?}"),
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let (acknowledged, unknown) = (
        acknowledged.load(Ordering::SeqCst),
        unknown.load(Ordering::SeqCst),
    );
    let counter = db.score(1).await.unwrap_or(0) as u32;
    let slowest = slowest_ms.load(Ordering::SeqCst);
    eprintln!(
        "{kind}: {} black-holed commits, {acknowledged} acknowledged, {unknown} unknown, \
         counter {counter}, slowest call {slowest} ms",
        proxy.cuts()
    );
    assert!(proxy.cuts() >= 2, "the proxy black-holed commits");
    assert!(
        acknowledged <= counter && counter <= acknowledged + unknown,
        "{kind}: counter {counter} outside [{acknowledged}, {}]",
        acknowledged + unknown
    );
}

servers::server_tests! {
    black_hole_local_postgres: black_holed_commits, LockKind::Local, postgres;
    black_hole_row_postgres: black_holed_commits, LockKind::Row, postgres;
    black_hole_pg_advisory_postgres: black_holed_commits, LockKind::PgAdvisory, postgres;
    black_hole_table_postgres: black_holed_commits, LockKind::Table, postgres;
    black_hole_local_mysql: black_holed_commits, LockKind::Local, mysql;
    black_hole_row_mysql: black_holed_commits, LockKind::Row, mysql;
    black_hole_table_mysql: black_holed_commits, LockKind::Table, mysql;
    black_hole_mysql_named_mysql: black_holed_commits, LockKind::MySqlNamed, mysql;
}

#[cfg(feature = "redis")]
servers::server_tests! {
    black_hole_redis_postgres: black_holed_commits, LockKind::Redis, postgres;
}
