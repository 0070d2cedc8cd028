//! A private server — PostgreSQL (initdb) or MariaDB (its own datadir), on a port of its own; the
//! shared servers are never touched — is restarted (`pg_ctl restart -m fast` / `mariadb-admin
//! shutdown` and start) or killed (`kill -9`) and started again while 4 tasks increment one row:
//! nothing acknowledged is lost or applied twice, and the first call succeeds within 2 s of the
//! server accepting connections again. Every backend that applies.
//!
//! The same crashes under keyed jobs (`jobs_survive_*`): workers run jobs of an in-transaction
//! kind and of a leased kind while the server goes down; every job ends done, and its effect is
//! in the database exactly once (SQLite has no server to restart).

#[macro_use]
#[path = "common/job_support.rs"]
mod job_support;
#[path = "common/private_mariadb.rs"]
mod private_mariadb;
#[path = "common/private_pg.rs"]
mod private_pg;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use entity::node;
use freshlock::{Error, LockKind, Session, UpdateOutcome};
use migration::{Migrator, MigratorTrait};
use private_mariadb::PrivateMariaDb;
use private_pg::PrivatePostgres;
use sea_orm::{EntityTrait, Set};

/// Either private server.
enum Private {
    Postgres(PrivatePostgres),
    MariaDb(PrivateMariaDb),
}

impl Private {
    /// A private PostgreSQL or MariaDB, started; `None` where the server tier does not run
    /// (the private-server tier runs where it runs).
    async fn start(mariadb: bool) -> Option<Self> {
        let shared = if mariadb {
            servers::MYSQL
        } else {
            servers::POSTGRES
        };
        servers::url(shared)?;
        let server = tokio::task::spawn_blocking(move || {
            if mariadb {
                Self::MariaDb(PrivateMariaDb::start())
            } else {
                Self::Postgres(PrivatePostgres::start())
            }
        })
        .await
        .unwrap();
        Some(server)
    }

    fn url(&self) -> String {
        match self {
            Self::Postgres(server) => server.url(),
            Self::MariaDb(server) => server.url(),
        }
    }

    /// Crashes the server, starts it again and returns when it accepts connections.
    fn crash(&self, crash: Crash) -> Instant {
        match self {
            Self::Postgres(server) => {
                match crash {
                    Crash::FastRestart => assert!(server.pg_ctl("-m fast -w restart")),
                    Crash::Kill9 => {
                        server.kill_postmaster();
                        server.start_again();
                    }
                }
                let deadline = Instant::now() + Duration::from_secs(30);
                while !server.accepting() {
                    assert!(Instant::now() < deadline);
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            Self::MariaDb(server) => match crash {
                Crash::Kill9 => server.kill9_and_restart(),
                Crash::FastRestart => server.restart(),
            },
        }
        Instant::now()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Crash {
    FastRestart,
    Kill9,
}

async fn survives(mariadb: bool, crash: Crash, kind: LockKind) {
    let Some(server) = Private::start(mariadb).await else {
        return;
    };
    let db = servers::crashable_pool(&server.url(), 6).await;
    Migrator::up(&db, None).await.unwrap();
    node::Entity::insert(node::ActiveModel::fresh(1))
        .exec(&db)
        .await
        .unwrap();
    let backend = kind.connect(&db, &server.url(), None).await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let (acknowledged, unknown, failed) = (
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
    );
    let successes = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let session = Session::builder(db.clone())
                .lock(Arc::clone(&backend))
                .policy(servers::crash_policy())
                .build()
                .unwrap();
            let (stop, acknowledged, unknown, failed, successes) = (
                Arc::clone(&stop),
                Arc::clone(&acknowledged),
                Arc::clone(&unknown),
                Arc::clone(&failed),
                Arc::clone(&successes),
            );
            tokio::spawn(async move {
                let nodes = session.repository::<node::Entity>();
                while !stop.load(Ordering::SeqCst) {
                    let call = nodes.locked_update(1, |n| {
                        let score = n.score.as_ref().unwrap_or(0);
                        n.score = Set(Some(score + 1));
                        Ok(())
                    });
                    match tokio::time::timeout(Duration::from_secs(60), call)
                        .await
                        .expect("no call hangs")
                    {
                        Ok(report) if report.outcome.is_updated() => {
                            acknowledged.fetch_add(1, Ordering::SeqCst);
                            successes.lock().unwrap().push(Instant::now());
                        }
                        // `mysql_named`: the crash ended the session holding the named lock
                        // between its grant and the write's check; `table` on PostgreSQL: the
                        // crash lost a grant not flushed yet (`LeaseLock::acquire_checked`), so
                        // the write's check failed. Nothing written, reported.
                        Ok(report) => {
                            let lease_lost_by_crash = kind == LockKind::MySqlNamed
                                || (kind == LockKind::Table && !mariadb);
                            assert!(
                                lease_lost_by_crash
                                    && matches!(report.outcome, UpdateOutcome::LeaseLost),
                                "{kind}: {:?}",
                                report.outcome
                            );
                            failed.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(Error::CommitUnknown { .. }) => {
                            unknown.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(_) => {
                            failed.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            })
        })
        .collect();
    let until = |count: u32| {
        let acknowledged = Arc::clone(&acknowledged);
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while acknowledged.load(Ordering::SeqCst) < count {
                assert!(tokio::time::Instant::now() < deadline, "the storm stalled");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    until(50).await;

    // The crash, and the moment the server accepts connections again.
    let server = Arc::new(server);
    let crashed = Arc::clone(&server);
    let ready = tokio::task::spawn_blocking(move || crashed.crash(crash))
        .await
        .unwrap();
    let before = acknowledged.load(Ordering::SeqCst);
    until(before + 50).await;
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await.unwrap();
    }

    let first_after = successes
        .lock()
        .unwrap()
        .iter()
        .copied()
        .filter(|at| *at >= ready)
        .min()
        .expect("calls succeeded after the restart");
    let recovery = first_after.duration_since(ready);
    let (acknowledged, unknown, failed) = (
        acknowledged.load(Ordering::SeqCst),
        unknown.load(Ordering::SeqCst),
        failed.load(Ordering::SeqCst),
    );
    let counter = node::Entity::find_by_id(1)
        .one(&db)
        .await
        .unwrap()
        .unwrap()
        .score
        .unwrap_or(0) as u32;
    eprintln!(
        "{kind} {crash:?}: {acknowledged} acknowledged, {unknown} unknown, {failed} reported \
         failures; counter {counter}; first success {recovery:?} after the server accepted \
         connections"
    );
    assert!(
        acknowledged <= counter && counter <= acknowledged + unknown,
        "{kind} {crash:?}: counter {counter} outside [{acknowledged}, {}]",
        acknowledged + unknown
    );
    assert!(
        recovery < Duration::from_secs(2),
        "{kind} {crash:?}: recovered {recovery:?} after the server's return"
    );
    drop(db);
}

macro_rules! crashes {
    ($($test:ident: $mariadb:expr, $crash:expr, $kind:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            survives($mariadb, $crash, $kind).await;
        }
    )*};
}

crashes! {
    postgres_restart_local: false, Crash::FastRestart, LockKind::Local;
    postgres_restart_table: false, Crash::FastRestart, LockKind::Table;
    postgres_restart_row: false, Crash::FastRestart, LockKind::Row;
    postgres_restart_pg_advisory: false, Crash::FastRestart, LockKind::PgAdvisory;
    postgres_kill9_local: false, Crash::Kill9, LockKind::Local;
    postgres_kill9_table: false, Crash::Kill9, LockKind::Table;
    postgres_kill9_row: false, Crash::Kill9, LockKind::Row;
    postgres_kill9_pg_advisory: false, Crash::Kill9, LockKind::PgAdvisory;
    mariadb_restart_local: true, Crash::FastRestart, LockKind::Local;
    mariadb_restart_table: true, Crash::FastRestart, LockKind::Table;
    mariadb_restart_row: true, Crash::FastRestart, LockKind::Row;
    mariadb_restart_mysql_named: true, Crash::FastRestart, LockKind::MySqlNamed;
    mariadb_kill9_local: true, Crash::Kill9, LockKind::Local;
    mariadb_kill9_table: true, Crash::Kill9, LockKind::Table;
    mariadb_kill9_row: true, Crash::Kill9, LockKind::Row;
    mariadb_kill9_mysql_named: true, Crash::Kill9, LockKind::MySqlNamed;
}

// ------------------------------------------------------------------------------------- jobs

const JOBS: i32 = 200;

/// Workers run keyed jobs — half of a kind that runs in the job's transaction, half of a leased
/// kind (claim, work outside any transaction, fenced finish) — while the server crashes and
/// comes back: every job ends done, its effect once; the completions the workers acknowledged
/// are among them.
async fn jobs_survive(mariadb: bool, crash: Crash) {
    use freshlock::jobs::{self, Job, JobOutcome, Jobs, NewJob, RetryPolicy, Worker};
    use job_support::{bump, bump_output};

    let Some(server) = Private::start(mariadb).await else {
        return;
    };
    let db = servers::crashable_pool(&server.url(), 8).await;
    Migrator::up(&db, None).await.unwrap();
    let nodes: Vec<_> = (1..=5).map(node::ActiveModel::fresh).collect();
    node::Entity::insert_many(nodes).exec(&db).await.unwrap();
    for seq in 0..JOBS {
        let node = seq % 5 + 1;
        let kind = if seq % 2 == 0 { "bump" } else { "leased" };
        let job = NewJob::new(kind, &node).unwrap();
        // Nodes 1–4 are keys; node 5's jobs have none.
        let job = if node < 5 {
            job.key(format!("node:{node}"))
        } else {
            job
        };
        jobs::enqueue(&db, job).await.unwrap();
    }
    // Enough attempts for a job whose lease expired while the server was down.
    let policy = RetryPolicy::default()
        .with_max_attempts(20)
        .with_backoff(Duration::from_millis(10), Duration::from_millis(100));
    let handlers = Jobs::new()
        .handle(
            "bump",
            policy.clone(),
            jobs::handler(|tx, job: Job<i32>| {
                Box::pin(async move {
                    bump(tx, job.payload).await?;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    Ok(())
                })
            }),
        )
        .handle_leased(
            "leased",
            policy,
            Duration::from_secs(1),
            |job: Job<i32>, _lease| async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok::<_, freshlock::ApplyError>(job.payload)
            },
            bump_output,
        );
    let stop = Arc::new(AtomicBool::new(false));
    let (acknowledged, unknown) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let session = Session::builder(db.clone())
        .policy(servers::crash_policy())
        .build()
        .unwrap();
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let worker = Worker::new(session.clone(), handlers.clone()).with_batch(if i == 0 {
                4
            } else {
                1
            });
            let (stop, acknowledged, unknown) = (
                Arc::clone(&stop),
                Arc::clone(&acknowledged),
                Arc::clone(&unknown),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let ran = tokio::time::timeout(Duration::from_secs(60), worker.run_batch())
                        .await
                        .expect("no run hangs");
                    match ran {
                        Ok(runs) if runs.is_empty() => {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        Ok(runs) => {
                            let done = runs
                                .iter()
                                .filter(|r| r.outcome == JobOutcome::Completed)
                                .count();
                            acknowledged.fetch_add(done as u32, Ordering::SeqCst);
                        }
                        Err(Error::CommitUnknown { .. }) => {
                            unknown.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            })
        })
        .collect();
    let until = |count: u32| {
        let acknowledged = Arc::clone(&acknowledged);
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
            while acknowledged.load(Ordering::SeqCst) < count {
                assert!(tokio::time::Instant::now() < deadline, "the jobs stalled");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    until(40).await;
    let server = Arc::new(server);
    let crashed = Arc::clone(&server);
    let at_crash = acknowledged.load(Ordering::SeqCst);
    tokio::task::spawn_blocking(move || crashed.crash(crash))
        .await
        .unwrap();
    assert!(
        at_crash < JOBS as u32 / 2,
        "the crash came mid-run ({at_crash} done)"
    );
    // Every job done: counted in the database (acknowledgements may be lost with replies).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let done = jobs_done(&db).await;
        if done == Some(i64::from(JOBS)) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{done:?} of {JOBS} jobs done"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.unwrap();
    }
    let (acknowledged, unknown) = (
        acknowledged.load(Ordering::SeqCst),
        unknown.load(Ordering::SeqCst),
    );
    let scores: i64 = node::Entity::find()
        .all(&db)
        .await
        .unwrap()
        .iter()
        .map(|n| i64::from(n.score.unwrap_or(0)))
        .sum();
    eprintln!(
        "jobs {crash:?} (mariadb: {mariadb}): {at_crash} completions acknowledged at the crash, \
         {acknowledged} in all, {unknown} runs unknown; {scores} effects for {JOBS} jobs"
    );
    assert!(acknowledged <= JOBS as u32, "{acknowledged} acknowledged");
    assert_eq!(
        scores,
        i64::from(JOBS),
        "every job's effect is in the database exactly once"
    );
    drop(db);
}

/// How many jobs are done, or `None` while the server does not answer.
async fn jobs_done(db: &sea_orm::DatabaseConnection) -> Option<i64> {
    use sea_orm::ConnectionTrait;
    let sql = "SELECT COUNT(*) FROM freshlock_job WHERE state = 2";
    let statement = sea_orm::Statement::from_string(db.get_database_backend(), sql);
    let row = db.query_one_raw(statement).await.ok()??;
    row.try_get_by_index::<i64>(0).ok()
}

macro_rules! job_crashes {
    ($($test:ident: $mariadb:expr, $crash:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            jobs_survive($mariadb, $crash).await;
        }
    )*};
}

job_crashes! {
    jobs_survive_postgres_restart: false, Crash::FastRestart;
    jobs_survive_postgres_kill9: false, Crash::Kill9;
    jobs_survive_mariadb_restart: true, Crash::FastRestart;
    jobs_survive_mariadb_kill9: true, Crash::Kill9;
}
