//! Databases for tests that need more than in-memory SQLite: a SQLite file, and isolated
//! PostgreSQL schemas / MariaDB databases on the servers named by the environment.
//!
//! Without a server's URL a test prints why it skips and passes; with
//! `FRESHLOCK_REQUIRE_SERVERS=1` (set by `.ci/run`) a missing URL fails the test instead.
#![allow(dead_code)]

use std::{
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use migration::{Migrator, MigratorTrait};
use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection};

pub const POSTGRES: &str = "DATABASE_URL_POSTGRES";
pub const MYSQL: &str = "DATABASE_URL_MYSQL";
pub const REDIS: &str = "REDIS_URL";
/// PgBouncer in transaction mode in front of the `POSTGRES` server (its root URL, no database):
/// when set, every PostgreSQL test database is reached through it (see `.ci/pgbouncer`).
pub const POSTGRES_POOLER: &str = "DATABASE_URL_POSTGRES_POOLER";

/// The pooler's root URL, when PostgreSQL tests run through PgBouncer.
pub fn pooler() -> Option<String> {
    std::env::var(POSTGRES_POOLER)
        .ok()
        .filter(|url| !url.is_empty())
        .map(|url| url.trim_end_matches('/').to_owned())
}

/// `url` with its database name replaced by `name`.
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let rest = base.split_once("://").map_or(base, |(_, rest)| rest);
    let root = match rest.split_once('/') {
        Some((host, _)) => &base[..base.len() - rest.len() + host.len()],
        None => base,
    };
    match query {
        Some(query) => format!("{root}/{name}?{query}"),
        None => format!("{root}/{name}"),
    }
}

/// The test binaries that take Redis leases, each given a logical database of its own (1 to 15;
/// any other binary shares database 0). Redis keys are named by the lock alone
/// (`freshlock:node:1`), so without this one binary's leases reach the next: a lease whose
/// release a test's end cut off (its runtime shut down before the background release ran) lives
/// out its TTL, and the next binary's writer of `node:1` waits for it.
const REDIS_BINARIES: [&str; 15] = [
    "backend_kill",
    "black_hole",
    "checkout_ping",
    "commit_faults",
    "cross_process",
    "exact_names",
    "get_or_insert",
    "lock_contract",
    "lock_rows",
    "locked_delete",
    "locked_section",
    "redis_refusal",
    "small_pool",
    "storm",
    "transaction_pooler",
];

/// `url` (a Redis URL) with this test binary's logical database in place of its own.
pub fn redis_database(url: &str) -> String {
    let binary = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_default();
    // Cargo names a test binary `<name>-<hash>`.
    let name = binary
        .rsplit_once('-')
        .map_or(binary.as_str(), |(name, _)| name);
    let index = REDIS_BINARIES
        .iter()
        .position(|known| *known == name)
        .map_or(0, |i| i + 1);
    with_database(url, &index.to_string())
}

/// The URL in `var`, or `None` (after saying why) when the test should skip.
pub fn url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() && var == REDIS => Some(redis_database(&url)),
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var_os("FRESHLOCK_REQUIRE_SERVERS").is_none(),
                "{var} is not set, but FRESHLOCK_REQUIRE_SERVERS says this run needs it"
            );
            eprintln!("SKIPPED: {var} is not set; this test needs that server");
            None
        }
    }
}

/// A free TCP port on 127.0.0.1, for a private server: chosen at random *below* the ephemeral
/// range (32768–60999 here). A port the OS hands out for `bind(0)` is an ephemeral port, which
/// any outgoing connection of a concurrent test (there are hundreds) may take between the check
/// and the server's own bind — a private server then fails to start. Below the range only
/// another test's choice can collide, one chance in thousands, and the bind check catches the
/// ports already taken.
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let port = fastrand::u16(20_000..32_000);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in 20000..32000")
}

/// A name no other test (of this or a concurrent process) uses, of at most 63 bytes: the
/// longest PostgreSQL name. A longer database name is cut there by the server, in `CREATE
/// DATABASE` and when a client connects, but not by PgBouncer, which then finds no such
/// database — so a long test name failed behind the pooler whenever the process id had one
/// more digit. The tag is cut to fit (the process id, time and sequence keep it unique).
pub fn unique(tag: &str) -> String {
    static SEQUENCE: AtomicU32 = AtomicU32::new(0);
    const LONGEST: usize = 63;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let suffix = format!(
        "_{}_{:x}_{}",
        std::process::id(),
        nanos,
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    );
    let mut end = tag.len().min(LONGEST - "fl_".len() - suffix.len());
    while !tag.is_char_boundary(end) {
        end -= 1;
    }
    format!("fl_{}{suffix}", &tag[..end])
}

/// Where a test database lives, so other processes can connect to it.
#[derive(Clone, Debug)]
pub struct TestDb {
    pub db: DatabaseConnection,
    /// The handle of `db`'s pool, as an application keeps it: marked when the pool is reached
    /// through a transaction pooler (`freshlock::transaction_pooler::adopt`), so sessions,
    /// lock backends and claims made from it wrap their single statements.
    pub handle: freshlock::Db,
    /// A URL other processes can use (with `search_path` for PostgreSQL).
    pub url: String,
    /// For PostgreSQL: the schema to put on the search path.
    pub schema: Option<String>,
}

/// A plain pool of `size` connections on `url` (nothing migrated), with short connect and
/// acquire timeouts: for a server of the test's own that the test crashes and restarts.
pub async fn crashable_pool(url: &str, size: u32) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(2))
        .sqlx_logging(false);
    Database::connect(options).await.unwrap()
}

/// The crash tests' lock policy: one try that waits up to 30 s, a 30 s lease, and on without the
/// lock when it cannot be had (so a frozen key shows as calls that waited 30 s).
pub fn crash_policy() -> freshlock::LockPolicy {
    freshlock::LockPolicy::default()
        .with_lock_tries(1)
        .with_wait_per_try(Duration::from_secs(30))
        .with_ttl(Duration::from_secs(30))
        .with_on_failure(freshlock::OnLockFailure::Proceed)
}

/// Connects to `url` (with `schema` on the search path) with the example schema migrated.
pub async fn connect(url: &str, schema: Option<&str>, max: u32) -> DatabaseConnection {
    handle(url, schema, max).await.connection().clone()
}

/// [`connect`]'s handle: through a transaction pooler, the one `adopt` marked.
pub async fn handle(url: &str, schema: Option<&str>, max: u32) -> freshlock::Db {
    #[cfg(feature = "postgres")]
    if let Some(pooler) = pooler()
        && url.starts_with(&pooler)
    {
        let mut options = ConnectOptions::new(url);
        options
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(30))
            .sqlx_logging(false);
        return freshlock::transaction_pooler::connect(options)
            .await
            .expect("connect through the transaction pooler");
    }
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .sqlx_logging(false);
    if let Some(schema) = schema {
        // The schema also names the connections, so a test can find its own sessions.
        options
            .set_schema_search_path(schema)
            .set_application_name(schema);
    }
    if url.starts_with("sqlite:") {
        let file = url
            .trim_start_matches("sqlite://")
            .trim_start_matches("sqlite:");
        let file = file.split('?').next().unwrap_or(file).to_owned();
        options.map_sqlx_sqlite_opts(move |o| {
            o.filename(&file)
                .create_if_missing(true)
                .journal_mode(sea_orm::sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(30))
        });
    }
    freshlock::Db::new(Database::connect(options).await.expect("connect"))
}

/// A fresh SQLite file database (WAL, busy timeout) in the temp directory.
pub async fn sqlite_file(tag: &str) -> TestDb {
    let path = std::env::temp_dir().join(format!("{}.db", unique(tag)));
    let url = format!("sqlite://{}", path.display());
    let db = connect(&url, None, 4).await;
    Migrator::up(&db, None).await.expect("migrate");
    TestDb {
        handle: freshlock::Db::new(db.clone()),
        db,
        url,
        schema: None,
    }
}

/// A fresh PostgreSQL schema with the example tables, or `None` without a server.
pub async fn postgres(tag: &str) -> Option<TestDb> {
    let url = url(POSTGRES)?;
    if let Some(pooler) = pooler() {
        return Some(through_pooler(&url, &pooler, tag).await);
    }
    let schema = unique(tag);
    let admin = connect(&url, None, 1).await;
    admin
        .execute_unprepared(&format!("CREATE SCHEMA \"{schema}\""))
        .await
        .expect("create schema");
    admin.close().await.ok();
    let db = connect(&url, Some(&schema), 8).await;
    Migrator::up(&db, None).await.expect("migrate");
    Some(TestDb {
        handle: freshlock::Db::new(db.clone()),
        db,
        url,
        schema: Some(schema),
    })
}

/// A fresh PostgreSQL database with the example tables, made and migrated on the server
/// directly, then reached through the transaction pooler (a schema on the search path would be
/// lost there: the pooler does not keep a client's `SET`).
async fn through_pooler(direct: &str, pooler: &str, tag: &str) -> TestDb {
    let name = unique(tag);
    let admin = connect(direct, None, 1).await;
    admin
        .execute_unprepared(&format!("CREATE DATABASE \"{name}\""))
        .await
        .expect("create database");
    admin.close().await.ok();
    let migrator = connect(&with_database(direct, &name), None, 1).await;
    Migrator::up(&migrator, None).await.expect("migrate");
    migrator.close().await.ok();
    let url = with_database(pooler, &name);
    let handle = handle(&url, None, 8).await;
    TestDb {
        db: handle.connection().clone(),
        handle,
        url,
        schema: None,
    }
}

/// A fresh MariaDB/MySQL database with the example tables, or `None` without a server.
pub async fn mysql(tag: &str) -> Option<TestDb> {
    let base = url(MYSQL)?;
    let name = unique(tag);
    let admin = connect(&base, None, 1).await;
    admin
        .execute_unprepared(&format!("CREATE DATABASE `{name}`"))
        .await
        .expect("create database");
    admin.close().await.ok();
    let root = base
        .rsplit_once('/')
        .map_or(base.as_str(), |(root, _)| root);
    let url = format!("{root}/{name}");
    let db = connect(&url, None, 8).await;
    Migrator::up(&db, None).await.expect("migrate");
    Some(TestDb {
        handle: freshlock::Db::new(db.clone()),
        db,
        url,
        schema: None,
    })
}

/// Connections of `db`'s pool checked out right now.
pub fn connections_in_use(db: &DatabaseConnection) -> usize {
    fn in_use(size: u32, idle: usize) -> usize {
        (size as usize).saturating_sub(idle)
    }
    match db.get_database_backend() {
        #[cfg(feature = "postgres")]
        sea_orm::DbBackend::Postgres => {
            let pool = db.get_postgres_connection_pool();
            in_use(pool.size(), pool.num_idle())
        }
        #[cfg(feature = "mysql")]
        sea_orm::DbBackend::MySql => {
            let pool = db.get_mysql_connection_pool();
            in_use(pool.size(), pool.num_idle())
        }
        _ => {
            let pool = db.get_sqlite_connection_pool();
            in_use(pool.size(), pool.num_idle())
        }
    }
}

impl TestDb {
    /// The score of node `id` as the database has it now.
    pub async fn score(&self, id: i32) -> Option<i32> {
        use sea_orm::{EntityTrait, TransactionTrait};
        // In a transaction: behind a transaction pooler no statement may run outside one.
        let txn = self.db.begin().await.expect("begin");
        let score = entity::node::Entity::find_by_id(id)
            .one(&txn)
            .await
            .expect("query")
            .expect("row exists")
            .score;
        txn.commit().await.expect("commit");
        score
    }

    /// Every node, as the database has it now (read in a transaction, so also through a
    /// transaction pooler).
    pub async fn all_nodes(&self) -> Vec<entity::node::Model> {
        use sea_orm::{EntityTrait, TransactionTrait};
        let txn = self.db.begin().await.expect("begin");
        let rows = entity::node::Entity::find()
            .all(&txn)
            .await
            .expect("read nodes");
        txn.commit().await.expect("commit");
        rows
    }

    /// Polls `sql` (a count, in its first column) until it is not 0: `what` has happened.
    pub async fn until(&self, sql: &str, what: &str) {
        let mut polls = 0;
        while self
            .query_one(sql)
            .await
            .try_get_by_index::<i64>(0)
            .unwrap()
            == 0
        {
            polls += 1;
            assert!(polls < 3000, "never: {what}");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// The first row of `sql`, read in a transaction (so also through a transaction pooler).
    pub async fn query_one(&self, sql: &str) -> sea_orm::QueryResult {
        use sea_orm::{ConnectionTrait, TransactionTrait};
        let txn = self.db.begin().await.expect("begin");
        let row = txn
            .query_one_raw(sea_orm::Statement::from_string(
                self.db.get_database_backend(),
                sql.to_owned(),
            ))
            .await
            .expect("query")
            .expect("a row");
        txn.commit().await.expect("commit");
        row
    }

    /// The database's name, for a test that reaches it through a pooler but must talk to the
    /// server directly (`None` for a schema on the search path or SQLite).
    pub fn direct_url(&self) -> Option<String> {
        let direct = std::env::var(POSTGRES).ok()?;
        pooler().filter(|p| self.url.starts_with(p.as_str()))?;
        let name = self.url.rsplit('/').next()?;
        Some(with_database(&direct, name))
    }

    /// Inserts nodes 1..=n with empty worker columns.
    pub async fn seed_nodes(&self, n: i32) {
        use sea_orm::{EntityTrait, TransactionTrait};
        let rows: Vec<_> = (1..=n).map(entity::node::ActiveModel::fresh).collect();
        let txn = self.db.begin().await.expect("begin");
        for chunk in rows.chunks(500) {
            entity::node::Entity::insert_many(chunk.to_vec())
                .exec(&txn)
                .await
                .expect("seed nodes");
        }
        txn.commit().await.expect("commit");
    }
}

/// The three databases by name, for test macros: `None` means skip (no URL, outside CI).
pub mod databases {
    use super::TestDb;

    pub async fn sqlite(tag: &str) -> Option<TestDb> {
        Some(super::sqlite_file(tag).await)
    }

    #[allow(unused_variables)]
    pub async fn postgres(tag: &str) -> Option<TestDb> {
        #[cfg(feature = "postgres")]
        return super::postgres(tag).await;
        #[cfg(not(feature = "postgres"))]
        {
            super::url(super::POSTGRES)?;
            panic!("DATABASE_URL_POSTGRES is set: run with --features postgres");
        }
    }

    #[allow(unused_variables)]
    pub async fn mysql(tag: &str) -> Option<TestDb> {
        #[cfg(feature = "mysql")]
        return super::mysql(tag).await;
        #[cfg(not(feature = "mysql"))]
        {
            super::url(super::MYSQL)?;
            panic!("DATABASE_URL_MYSQL is set: run with --features mysql");
        }
    }
}

/// One multi-threaded `#[tokio::test]` per line `name: scenario, LockKind::…, database;`, running
/// `scenario(databases::database("name").await, kind)`; the scenario skips on `None` (no URL).
/// Invoke it where `databases` is in scope.
#[allow(unused_macros)]
macro_rules! server_tests {
    ($($test:ident: $scenario:ident, $kind:expr, $db:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            $scenario(databases::$db(stringify!($test)).await, $kind).await;
        }
    )*};
}
#[allow(unused_imports)]
pub(crate) use server_tests;
