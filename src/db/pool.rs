//! A connection pool as freshlock uses it ([`Pool`]): the sea-orm connection and what freshlock
//! learns of it — whether its transactions already run at READ COMMITTED (then `BEGIN` needs no
//! `SET TRANSACTION`: one round trip less per locked write), whether it runs behind a
//! transaction pooler, the server incarnation a commit's evidence is read against, and how many
//! commit markers its writes left for the sweep. Owned by the handle, shared by its clones:
//! never found by the pool's address.

use std::{
    ops::Deref,
    sync::{
        Arc, Mutex, OnceLock, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use tracing::debug;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use super::prepared::Known;

/// A sea-orm connection pool and what freshlock keeps of it. Cheap to clone: clones share
/// everything. Dereferences to the connection.
#[derive(Clone, Debug)]
pub(crate) struct Pool {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    conn: DatabaseConnection,
    /// A sqlx pool (not a mock connection, which has none of the state below: its writes are
    /// never combined, it reads no isolation level and no incarnation).
    real: bool,
    /// Runs behind a transaction pooler (see [`Pool::transaction_pooled`]).
    pooled: AtomicBool,
    /// Whether the pool's transactions run at READ COMMITTED by default, once read.
    read_committed: OnceLock<bool>,
    /// Whether the database has `freshlock_incarnation` (PostgreSQL), once read.
    incarnation_table: OnceLock<bool>,
    /// The server incarnation's token as last seen in `freshlock_incarnation`, and when.
    incarnation: Mutex<Option<(Arc<str>, Instant)>>,
    /// Commit markers written on this pool (see `commit/marker.rs`'s sweep).
    markers: AtomicU64,
    /// freshlock's statements prepared on each connection, as last read (`prepared/`).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    prepared: Arc<Known>,
}

impl Deref for Pool {
    type Target = DatabaseConnection;

    fn deref(&self) -> &DatabaseConnection {
        &self.inner.conn
    }
}

impl Pool {
    /// `conn` with nothing learnt of it yet.
    pub(crate) fn new(conn: DatabaseConnection) -> Self {
        use sea_orm::DatabaseConnectionType as Type;
        let real = match &conn.inner {
            #[cfg(feature = "sqlite")]
            Type::SqlxSqlitePoolConnection(_) => true,
            #[cfg(feature = "postgres")]
            Type::SqlxPostgresPoolConnection(_) => true,
            #[cfg(feature = "mysql")]
            Type::SqlxMySqlPoolConnection(_) => true,
            _ => false,
        };
        Self {
            inner: Arc::new(Inner {
                conn,
                real,
                pooled: AtomicBool::new(false),
                read_committed: OnceLock::new(),
                incarnation_table: OnceLock::new(),
                incarnation: Mutex::new(None),
                markers: AtomicU64::new(0),
                #[cfg(any(feature = "postgres", feature = "mysql"))]
                prepared: Arc::new(Known::new()),
            }),
        }
    }

    /// The sea-orm connection.
    pub(crate) fn connection(&self) -> &DatabaseConnection {
        &self.inner.conn
    }

    /// Whether this pool was declared to run behind a transaction pooler
    /// (`crate::transaction_pooler::adopt`): then no statement may run outside an explicit
    /// transaction (sqlx prepares and executes in two exchanges, and the pooler may hand the
    /// second to another server connection), and freshlock wraps its own single statements in
    /// one (see [`Autocommit`](super::autocommit::Autocommit)).
    pub(crate) fn transaction_pooled(&self) -> bool {
        self.inner.pooled.load(Ordering::Relaxed)
    }

    /// Declares that this pool runs behind a transaction pooler (checked by the caller).
    #[cfg(feature = "postgres")]
    pub(crate) fn mark_transaction_pooled(&self) {
        self.inner.pooled.store(true, Ordering::Relaxed);
    }

    /// Which of freshlock's statements each connection prepared, when freshlock's statements go
    /// by name on this pool (PostgreSQL, not behind a transaction pooler: `prepared/`).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn prepares(&self) -> Option<Arc<Known>> {
        let by_name =
            self.get_database_backend() == DbBackend::Postgres && !self.transaction_pooled();
        by_name.then(|| Arc::clone(&self.inner.prepared))
    }

    /// How many commit markers this pool's writes have written, this one included.
    pub(crate) fn marker_written(&self) -> u64 {
        self.inner.markers.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// What was read of the pool's default isolation level (see
    /// `begin::read_committed_by_default`): `None` until it was read.
    pub(crate) fn read_committed(&self) -> &OnceLock<bool> {
        &self.inner.read_committed
    }

    /// Whether this is a sqlx pool (not a mock connection, which has none of the state).
    pub(crate) fn is_real(&self) -> bool {
        self.inner.real
    }

    /// What this pool knows of the server incarnation (see [`Incarnation`]). `on` is where to
    /// ask the first time: the write's own transaction, never another connection of the pool (a
    /// pool whose every connection is in a write that waits for one more would wait for good).
    ///
    /// Whether the database has `freshlock_incarnation` ([`crate::schema::IncarnationMigration`])
    /// is read once per pool: `Unsupported` while the database cannot be asked (asked again next
    /// time), and for good when the table is missing — such a pool keeps writing commit markers
    /// until the process restarts, so run the migrations before the first write.
    ///
    /// Why a token seen earlier (not in the write's own transaction) is evidence enough: the
    /// write's transaction id is given out after the token was seen, so after its row was
    /// created. While the row is still there no crash recovery has happened since (it would have
    /// emptied the table; tokens are never used again), so neither since the id was given out:
    /// `txid_status` speaks of this write. A token gone stale by a crash only keeps a resolution
    /// from trusting `committed`; the stale token is forgotten then ([`Pool::forget_incarnation`]), and
    /// within [`INCARNATION_FRESH`] anyway.
    pub(crate) async fn incarnation(&self, on: &impl ConnectionTrait) -> Incarnation {
        if self.get_database_backend() != DbBackend::Postgres || !self.inner.real {
            return Incarnation::Unsupported;
        }
        if !self.has_incarnation_table(on).await {
            return Incarnation::Unsupported;
        }
        match &*self.seen() {
            Some((token, at)) if at.elapsed() < INCARNATION_FRESH => {
                Incarnation::Known(Arc::clone(token))
            }
            _ => Incarnation::Unseen,
        }
    }

    /// Remembers that `token` is the server incarnation now (read from `freshlock_incarnation`).
    pub(crate) fn saw_incarnation(&self, token: &str) {
        let mut seen = self.seen();
        match &mut *seen {
            Some((known, at)) if **known == *token => *at = Instant::now(),
            _ => *seen = Some((Arc::from(token), Instant::now())),
        }
    }

    /// Forgets the incarnation token: it was found gone (the server recovered from a crash).
    pub(crate) fn forget_incarnation(&self) {
        *self.seen() = None;
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Option<(Arc<str>, Instant)>> {
        (self.inner.incarnation.lock()).unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the database (PostgreSQL) has `freshlock_incarnation`: asked on `on` once per
    /// pool.
    async fn has_incarnation_table(&self, on: &impl ConnectionTrait) -> bool {
        if let Some(answer) = self.inner.incarnation_table.get() {
            return *answer;
        }
        let query = format!(
            "SELECT to_regclass('{}') IS NOT NULL AS present",
            crate::schema::INCARNATION_TABLE
        );
        let answer = match on
            .query_one_raw(Statement::from_string(DbBackend::Postgres, query))
            .await
        {
            Ok(row) => row.is_some_and(|row| row.try_get::<bool>("", "present").unwrap_or(false)),
            Err(error) => {
                debug!(%error, "looking for freshlock_incarnation failed; writing commit markers");
                return false;
            }
        };
        if !answer {
            tracing::warn!(
                "freshlock_incarnation is missing (freshlock::schema::IncarnationMigration): \
                 locked writes on this pool write commit markers, which cost more"
            );
        }
        *self.inner.incarnation_table.get_or_init(|| answer)
    }
}

/// Makes every connection of the MySQL/MariaDB pool that `options` connects run its
/// transactions at READ COMMITTED by default: `SET SESSION TRANSACTION ISOLATION LEVEL READ
/// COMMITTED` as each connection is made (sqlx's `after_connect`, through
/// [`ConnectOptions::map_sqlx_mysql_pool_opts`](sea_orm::ConnectOptions::map_sqlx_mysql_pool_opts),
/// which replaces a mapping set before it; set yours first and call this last, or make your
/// own mapping run the same statement).
///
/// freshlock's transactions run at READ COMMITTED, which MySQL and MariaDB do not default to
/// (REPEATABLE READ): on such a pool each `BEGIN` needs a `SET TRANSACTION` before it, a round
/// trip of its own. On a pool whose connections default to it already — read once per pool —
/// that statement is skipped: a `locked_update` under `local` sends six statements instead of
/// seven (`tests/round_trips.rs`; see `BENCHMARKS.md` for what that is worth).
///
/// The application's own transactions on the pool run at READ COMMITTED too (as Django's do on
/// MySQL by default): reads within one of them see what other transactions committed since,
/// and no gap locks are taken. Setting `transaction_isolation` in the server's configuration
/// does the same for every client.
///
/// ```no_run
/// # async fn connect() -> Result<(), sea_orm::DbErr> {
/// let mut options = sea_orm::ConnectOptions::new("mysql://root@127.0.0.1:3306/test");
/// freshlock::db::mysql_read_committed(&mut options);
/// let db = sea_orm::Database::connect(options).await?;
/// # let _ = db;
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "mysql")]
pub fn mysql_read_committed(options: &mut sea_orm::ConnectOptions) -> &mut sea_orm::ConnectOptions {
    const SET: &str = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";
    options.map_sqlx_mysql_pool_opts(|pool| {
        pool.after_connect(|conn, _| {
            Box::pin(async move {
                sea_orm::sqlx::Executor::execute(conn, SET)
                    .await
                    .map(|_| ())
            })
        })
    })
}

/// How long a seen incarnation token is used without looking again: a write within this of the
/// last look returns only its transaction id; the first one after it also reads the token (see
/// [`Pool::incarnation`]).
pub(crate) const INCARNATION_FRESH: Duration = Duration::from_secs(1);

/// What a PostgreSQL write on a pool knows of the server's incarnation (see `commit/`).
#[derive(Debug)]
pub(crate) enum Incarnation {
    /// Not PostgreSQL, no `freshlock_incarnation` table, or not a sqlx pool: commit markers.
    Unsupported,
    /// The token was seen within [`INCARNATION_FRESH`]: the write need not read it.
    Known(Arc<str>),
    /// Not seen lately: the write reads it in its own statement.
    Unseen,
}
