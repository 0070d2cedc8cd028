//! A private PostgreSQL server (initdb on a port of its own — the shared server is never
//! touched) is restarted (`pg_ctl restart -m fast`) or killed (`kill -9` of the postmaster) and
//! started again while 4 tasks increment one row: nothing acknowledged is lost or applied twice,
//! and the first call succeeds within 2 s of the server accepting connections again. Every
//! backend that applies.

#[path = "common/servers.rs"]
mod servers;

use std::{
    path::PathBuf,
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use entity::node;
use freshlock::{Error, LockKind, LockPolicy, OnLockFailure, Session};
use migration::{Migrator, MigratorTrait};
use sea_orm::{ConnectOptions, Database, DatabaseConnection, EntityTrait, Set};

const BIN: &str = "/usr/lib/postgresql/15/bin";

fn as_postgres(command: &str) -> bool {
    Command::new("su")
        .args(["postgres", "-c", command])
        .status()
        .is_ok_and(|status| status.success())
}

/// A PostgreSQL cluster of this test's own, stopped and removed on drop.
struct PrivatePostgres {
    dir: PathBuf,
    port: u16,
}

impl PrivatePostgres {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(servers::unique("pgdata"));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(
            Command::new("chown")
                .args(["postgres:postgres", dir.to_str().unwrap()])
                .status()
                .unwrap()
                .success()
        );
        let d = dir.display();
        assert!(as_postgres(&format!(
            "{BIN}/initdb -D {d} -U postgres --auth=trust >/dev/null"
        )));
        let conf = format!(
            "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{d}'\n\
             fsync = off\n"
        );
        std::fs::write(
            dir.join("postgresql.conf"),
            std::fs::read_to_string(dir.join("postgresql.conf")).unwrap() + &conf,
        )
        .unwrap();
        let server = Self { dir, port };
        assert!(
            server.pg_ctl("-l {d}/log -w start"),
            "the private server starts"
        );
        server
    }

    fn pg_ctl(&self, args: &str) -> bool {
        let d = self.dir.display().to_string();
        as_postgres(&format!(
            "{BIN}/pg_ctl -D {d} {} >/dev/null",
            args.replace("{d}", &d)
        ))
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn kill_postmaster(&self) {
        let pid = std::fs::read_to_string(self.dir.join("postmaster.pid")).unwrap();
        let pid = pid.lines().next().unwrap().trim().to_owned();
        assert!(
            Command::new("kill")
                .args(["-9", &pid])
                .status()
                .unwrap()
                .success()
        );
    }

    /// Starts the server again after a kill (its orphaned backends may take a moment to go).
    fn start_again(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.pg_ctl("-l {d}/log -w start") {
            assert!(
                Instant::now() < deadline,
                "the private server did not start again"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn accepting(&self) -> bool {
        Command::new("pg_isready")
            .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            .status()
            .is_ok_and(|status| status.success())
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self.pg_ctl("-m immediate stop");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Crash {
    FastRestart,
    Kill9,
}

async fn pool(url: &str) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(2))
        .sqlx_logging(false);
    Database::connect(options).await.unwrap()
}

async fn survives(crash: Crash, kind: LockKind) {
    // The private-server tier runs where the server tier runs.
    if servers::url(servers::POSTGRES).is_none() {
        return;
    }
    let server = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap();
    let db = pool(&server.url()).await;
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
                .policy(
                    LockPolicy::default()
                        .with_tries(1)
                        .with_wait_per_try(Duration::from_secs(30))
                        .with_ttl(Duration::from_secs(30))
                        .with_on_failure(OnLockFailure::Proceed),
                )
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
                        Ok(report) => {
                            assert!(report.outcome.is_updated());
                            acknowledged.fetch_add(1, Ordering::SeqCst);
                            successes.lock().unwrap().push(Instant::now());
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
    let ready = tokio::task::spawn_blocking(move || {
        match crash {
            Crash::FastRestart => assert!(crashed.pg_ctl("-m fast -w restart")),
            Crash::Kill9 => {
                crashed.kill_postmaster();
                crashed.start_again();
            }
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while !crashed.accepting() {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(5));
        }
        Instant::now()
    })
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
    ($($test:ident: $crash:expr, $kind:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            survives($crash, $kind).await;
        }
    )*};
}

crashes! {
    restart_local: Crash::FastRestart, LockKind::Local;
    restart_table: Crash::FastRestart, LockKind::Table;
    restart_row: Crash::FastRestart, LockKind::Row;
    restart_pg_advisory: Crash::FastRestart, LockKind::PgAdvisory;
    kill9_local: Crash::Kill9, LockKind::Local;
    kill9_table: Crash::Kill9, LockKind::Table;
    kill9_row: Crash::Kill9, LockKind::Row;
    kill9_pg_advisory: Crash::Kill9, LockKind::PgAdvisory;
}
