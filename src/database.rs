//! [`Db`]: the handle an application keeps of one database, as it keeps the pool.

use std::{any::TypeId, fmt, sync::Arc};

use dashmap::DashMap;
use sea_orm::DatabaseConnection;

use crate::{db::pool::Pool, erased::Erased};

/// A database as freshlock uses it: a sea-orm connection pool, and what freshlock learns of
/// and keeps for it — the pool's default isolation level, whether it runs behind a transaction
/// pooler, the server incarnation a lost commit is resolved against, the commit-marker sweep's
/// count, and the rooms in which hot rows' writers share a commit
/// ([`SessionBuilder::combine_commits`](crate::SessionBuilder::combine_commits)).
///
/// Make one per pool when the application starts and keep it where the pool is kept
/// (application state); make sessions from it, one per request or job
/// (`Session::new(&db)`, `Session::builder(&db)`). Sessions made from one `Db` (or its
/// clones) combine their commits with each other and learn the pool's settings once. A session
/// made from a bare `DatabaseConnection` gets a `Db` of its own: it works the same, but shares
/// no commit with other sessions and asks the pool's settings again (one statement more on its
/// first write). Cheap to clone (an `Arc` inside); clones share everything.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let conn = sea_orm::Database::connect("sqlite::memory:").await?;
/// let db = freshlock::Db::new(conn); // once, at start-up
/// let per_request = freshlock::Session::new(&db);
/// # let _ = per_request;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Db {
    pool: Pool,
    rooms: Arc<Rooms>,
}

impl fmt::Debug for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Db")
            .field("backend", &self.pool.get_database_backend())
            .finish_non_exhaustive()
    }
}

impl Db {
    /// The handle of `conn`'s pool, with nothing learnt of it yet.
    pub fn new(conn: DatabaseConnection) -> Self {
        Self {
            pool: Pool::new(conn),
            rooms: Arc::default(),
        }
    }

    /// The sea-orm connection.
    pub fn connection(&self) -> &DatabaseConnection {
        self.pool.connection()
    }

    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    pub(crate) fn rooms(&self) -> &Arc<Rooms> {
        &self.rooms
    }
}

impl From<DatabaseConnection> for Db {
    /// A `Db` of its own for `conn` (see [`Db`]: make one per pool and share it instead).
    fn from(conn: DatabaseConnection) -> Self {
        Self::new(conn)
    }
}

impl From<&DatabaseConnection> for Db {
    /// A `Db` of its own for a clone of `conn` (see [`Db`]).
    fn from(conn: &DatabaseConnection) -> Self {
        Self::new(conn.clone())
    }
}

impl From<&Db> for Db {
    fn from(db: &Db) -> Self {
        db.clone()
    }
}

/// Which writes of one handle may share a commit: the name of a room of commit combining
/// (see `write/room.rs`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Which {
    /// The entity type.
    pub(crate) entity: TypeId,
    /// The lock space that excludes the process's writers of the row from each other (see
    /// `write::locking::exclusion`).
    pub(crate) exclusion: u64,
    /// The lock's name.
    pub(crate) lock: String,
    /// The row's name.
    pub(crate) row: String,
    /// The session's version column for the entity, if any.
    pub(crate) version: Option<&'static str>,
    /// Whether the session's writes carry commit evidence.
    pub(crate) markers: bool,
}

/// The rooms of one database handle. A room holds the waiters of one entity type (`Room<E>`,
/// see `write/room.rs`), so the map is a type map: each entry is found by a key holding the
/// entity's `TypeId` and read back as that entity's room.
#[derive(Default)]
pub(crate) struct Rooms(pub(crate) DashMap<Which, Erased>);
