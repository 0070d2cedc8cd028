//! Test support for applications built on freshlock (cargo feature `testing`).
//!
//! Three pieces, all used by freshlock's own test suite:
//!
//! - [`TestDatabase`]: an in-memory SQLite database that cannot vanish under a test. With plain
//!   `sqlite::memory:` the database lives only as long as some connection to it: sqlx closes a
//!   connection when a future is dropped in the middle of a query (a timeout, a cancelled
//!   request), and the pool closes idle ones, and when the last one closes the tables are gone
//!   ("no such table"). A `TestDatabase` is a *named* shared-cache in-memory database anchored by
//!   one extra connection that never runs a query and lives as long as the value or any clone of
//!   its [`DatabaseConnection`]. Your `Migrator` and freshlock's tables are applied.
//! - [`Recorder`]: every statement the connection sent after setup, so a test can assert
//!   "this call sent one SELECT and one UPDATE".
//! - [`FakeLock`]: a [`LockBackend`](crate::LockBackend) double with failure switches (never
//!   acquires, fails after N grants, slow, release fails, lease lost, interference in the write's
//!   transaction) for your own fault tests.
//!
//! ```
//! use freshlock::testing::TestDatabase;
//! use sea_orm::{ConnectionTrait, DbBackend, Statement};
//!
//! # tokio_test_block_on(async {
//! // With your own migrations: `TestDatabase::with_migrator::<migration::Migrator>()`.
//! let db = TestDatabase::new().await?;
//! db.execute_unprepared("CREATE TABLE note (id INTEGER PRIMARY KEY, body TEXT NOT NULL)").await?;
//! db.recorder().clear();
//! let insert = "INSERT INTO note VALUES (1, 'hello')";
//! db.execute_raw(Statement::from_string(DbBackend::Sqlite, insert)).await?;
//! assert_eq!(db.recorder().count("INSERT"), 1);
//! # Ok::<(), sea_orm::DbErr>(())
//! # }).unwrap();
//! # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
//! # }
//! ```

mod fake_lock;

use std::{
    fmt,
    ops::Deref,
    str::FromStr,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use sea_orm::{
    ConnectOptions, Database, DatabaseConnection, DbErr,
    sqlx::{ConnectOptions as _, sqlite::SqliteConnectOptions},
};
use sea_orm_migration::MigratorTrait;

pub use fake_lock::FakeLock;

use crate::{
    lock::LocalLock,
    session::{Session, SessionBuilder},
};

/// Statements a connection sent, in order, as SQL text with `?`/`$n` placeholders.
///
/// sea-orm reports statements through its metric callback, which does not show `BEGIN`,
/// `COMMIT` and `ROLLBACK`, nor statements sent with `execute_unprepared`: the recorder sees
/// every SELECT, INSERT, UPDATE and DELETE sea-orm builds or runs as a `Statement`, but not
/// transaction control.
#[derive(Clone, Default)]
pub struct Recorder(Arc<Mutex<Vec<String>>>);

impl Recorder {
    /// Everything recorded since the last [`take`](Self::take) or [`clear`](Self::clear), and
    /// starts over.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.log())
    }

    /// A copy of everything recorded so far.
    pub fn statements(&self) -> Vec<String> {
        self.log().clone()
    }

    /// Forgets what was recorded.
    pub fn clear(&self) {
        self.log().clear();
    }

    /// How many recorded statements begin with `verb` (case-insensitive), e.g. `"SELECT"`.
    pub fn count(&self, verb: &str) -> usize {
        count(&self.log(), verb)
    }

    /// Records one statement (the metric callback of a [`TestDatabase`] calls this; call it
    /// yourself to record a connection of your own).
    pub fn record(&self, statement: impl Into<String>) {
        self.log().push(statement.into());
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        // A test that panicked while holding the log leaves it usable for the next assertion.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.log().iter()).finish()
    }
}

/// How many of `statements` begin with `verb` (case-insensitive, leading blanks ignored).
fn count(statements: &[String], verb: &str) -> usize {
    statements
        .iter()
        .filter(|s| {
            let s = s.trim_start();
            s.len() >= verb.len()
                && s.is_char_boundary(verb.len())
                && s[..verb.len()].eq_ignore_ascii_case(verb)
        })
        .count()
}

/// An in-memory SQLite database for one test, with a [`Recorder`]; see the [module
/// docs](self) for why it cannot vanish. Dereferences to its [`DatabaseConnection`].
///
/// The pool has one connection, as sea-orm's SQLite default: a statement sent through the
/// connection while a transaction holds it waits — the same behaviour your code has in
/// production with SQLite.
pub struct TestDatabase {
    connection: DatabaseConnection,
    recorder: Recorder,
    url: String,
    lock: LocalLock,
}

/// The connection that keeps the named in-memory database alive; never used for a query.
struct Anchor(#[allow(dead_code)] Mutex<sea_orm::sqlx::SqliteConnection>);

static DATABASES: AtomicU64 = AtomicU64::new(0);

impl TestDatabase {
    /// A fresh database with freshlock's tables only.
    ///
    /// # Errors
    /// sqlx's error if SQLite cannot be opened, or a failing `CREATE TABLE`.
    pub async fn new() -> Result<Self, DbErr> {
        let db = Self::empty().await?;
        crate::schema::create_tables(&db.connection).await?;
        db.recorder.clear();
        Ok(db)
    }

    /// A fresh database with your migrations (`M::up`) and freshlock's tables (created when
    /// your `Migrator` does not include [`crate::schema::migrations`]).
    ///
    /// # Errors
    /// The error of the first migration that fails.
    pub async fn with_migrator<M: MigratorTrait>() -> Result<Self, DbErr> {
        let db = Self::empty().await?;
        M::up(&db.connection, None).await?;
        crate::schema::create_tables(&db.connection).await?;
        db.recorder.clear();
        Ok(db)
    }

    /// A fresh database with no tables at all (for tests of missing-table errors).
    ///
    /// # Errors
    /// sqlx's error if SQLite cannot be opened.
    pub async fn empty() -> Result<Self, DbErr> {
        let n = DATABASES.fetch_add(1, Ordering::Relaxed);
        let url = format!(
            "sqlite:file:freshlock-test-{}-{n}?mode=memory",
            std::process::id()
        );
        let anchor = SqliteConnectOptions::from_str(&url)
            .map_err(|e| DbErr::Custom(format!("test database URL {url}: {e}")))?
            .connect()
            .await
            .map_err(|e| DbErr::Custom(format!("opening the test database {url}: {e}")))?;
        let anchor = Arc::new(Anchor(Mutex::new(anchor)));

        let mut options = ConnectOptions::new(url.clone());
        options
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .sqlx_logging(false);
        let mut connection = Database::connect(options).await?;
        let recorder = Recorder::default();
        let sink = recorder.clone();
        // The callback lives inside the connection (and its clones): so does the anchor.
        connection.set_metric_callback(move |info| {
            let _keep_alive = &anchor;
            sink.record(info.statement.to_string());
        });
        Ok(Self {
            connection,
            recorder,
            url,
            lock: LocalLock::new(),
        })
    }

    /// The connection (a cheap clone shares the pool, the recorder and the anchor).
    pub fn connection(&self) -> &DatabaseConnection {
        &self.connection
    }

    /// The statements sent since setup (or since the last `take`/`clear`).
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    /// The database's URL: another `Database::connect` to it reaches the same tables while
    /// this value lives.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A session on this database with the default policy. Sessions of one `TestDatabase`
    /// share an in-process lock space of their own — like workers of one process — so tests
    /// running in parallel never wait for each other's locks.
    pub fn session(&self) -> Session {
        Session::builder(self.connection.clone())
            .lock(Arc::new(self.lock.clone()))
            .build_unchecked()
    }

    /// A session builder on this database with its in-process lock space (see
    /// [`session`](Self::session)), to set a policy, a cache capacity or a [`FakeLock`].
    pub fn session_builder(&self) -> SessionBuilder {
        Session::builder(self.connection.clone()).lock(Arc::new(self.lock.clone()))
    }

    /// The in-process lock space of this database's sessions.
    pub fn lock(&self) -> &LocalLock {
        &self.lock
    }
}

impl Deref for TestDatabase {
    type Target = DatabaseConnection;

    fn deref(&self) -> &DatabaseConnection {
        &self.connection
    }
}

impl fmt::Debug for TestDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestDatabase")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}
