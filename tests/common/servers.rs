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

/// The URL in `var`, or `None` (after saying why) when the test should skip.
pub fn url(var: &str) -> Option<String> {
    match std::env::var(var) {
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

/// A free TCP port on 127.0.0.1, for a private server.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("its address")
        .port()
}

/// A name no other test (of this or a concurrent process) uses.
pub fn unique(tag: &str) -> String {
    static SEQUENCE: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "fl_{tag}_{}_{:x}_{}",
        std::process::id(),
        nanos,
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    )
}

/// Where a test database lives, so other processes can connect to it.
#[derive(Clone, Debug)]
pub struct TestDb {
    pub db: DatabaseConnection,
    /// A URL other processes can use (with `search_path` for PostgreSQL).
    pub url: String,
    /// For PostgreSQL: the schema to put on the search path.
    pub schema: Option<String>,
}

/// Connects to `url` (with `schema` on the search path) with the example schema migrated.
pub async fn connect(url: &str, schema: Option<&str>, max: u32) -> DatabaseConnection {
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
    Database::connect(options).await.expect("connect")
}

/// A fresh SQLite file database (WAL, busy timeout) in the temp directory.
pub async fn sqlite_file(tag: &str) -> TestDb {
    let path = std::env::temp_dir().join(format!("{}.db", unique(tag)));
    let url = format!("sqlite://{}", path.display());
    let db = connect(&url, None, 4).await;
    Migrator::up(&db, None).await.expect("migrate");
    TestDb {
        db,
        url,
        schema: None,
    }
}

/// A fresh PostgreSQL schema with the example tables, or `None` without a server.
pub async fn postgres(tag: &str) -> Option<TestDb> {
    let url = url(POSTGRES)?;
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
        db,
        url,
        schema: Some(schema),
    })
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
        use sea_orm::EntityTrait;
        entity::node::Entity::find_by_id(id)
            .one(&self.db)
            .await
            .expect("query")
            .expect("row exists")
            .score
    }

    /// Inserts nodes 1..=n with empty worker columns.
    pub async fn seed_nodes(&self, n: i32) {
        use sea_orm::EntityTrait;
        let rows: Vec<_> = (1..=n).map(entity::node::ActiveModel::fresh).collect();
        for chunk in rows.chunks(500) {
            entity::node::Entity::insert_many(chunk.to_vec())
                .exec(&self.db)
                .await
                .expect("seed nodes");
        }
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
