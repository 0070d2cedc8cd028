//! A unit of work: connection, identity map, lock backend and lock policy.

use std::{
    any::TypeId,
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use sea_orm::{ColumnTrait, ColumnType, DatabaseConnection, EntityTrait, IdenStatic, Iterable};

use crate::{
    database::Db,
    db::pool::Pool,
    error::Result,
    identity_map::{CacheStats, IdentityMap},
    lock::{LocalLock, LockBackend, LockPolicy},
};

/// One unit of work (a job, a worker, a request): the database ([`Db`]), an identity map, a
/// lock backend and a lock policy.
///
/// Make sessions from the one [`Db`] the application keeps (`Session::new(&db)`): sessions of
/// one `Db` combine commits and share what was learnt of the pool. A session made from a bare
/// `DatabaseConnection` gets a `Db` of its own (see [`Db`]).
///
/// Cloning is cheap (an `Arc` inside) and clones share everything, so the tasks of one job can
/// each hold one. Sessions of different jobs should be separate (each has its own cache), but
/// share a lock backend so they exclude each other: [`Session::new`] uses the process-wide
/// [`LocalLock::shared`].
#[derive(Clone, Debug)]
pub struct Session {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    db: Db,
    replica: Option<Pool>,
    map: IdentityMap,
    lock: Arc<dyn LockBackend>,
    policy: LockPolicy,
    versions: HashMap<TypeId, &'static str>,
    commit_markers: bool,
    optimistic_first: bool,
    combine_commits: bool,
    two_flights: bool,
    in_flight: AtomicUsize,
}

/// Counts a locked section as running until dropped.
pub(crate) struct InFlight(Session);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inner.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Session {
    /// A session on `db` (a `&Db`, a `Db`, or a bare `DatabaseConnection`: see [`Db`]) with
    /// the process-wide in-process lock, the default [`LockPolicy`] and an unbounded identity
    /// map.
    pub fn new(db: impl Into<Db>) -> Self {
        Self::builder(db).build_unchecked()
    }

    /// A builder to choose the lock backend, the policy and the cache bound (`db` as for
    /// [`new`](Self::new)).
    pub fn builder(db: impl Into<Db>) -> SessionBuilder {
        SessionBuilder {
            db: db.into(),
            lock: None,
            policy: LockPolicy::default(),
            capacity: None,
            versions: HashMap::new(),
            invalid_version: None,
            commit_markers: None,
            optimistic_first: false,
            combine_commits: false,
            two_flights: false,
            replica: None,
        }
    }

    /// The database connection.
    pub fn connection(&self) -> &DatabaseConnection {
        self.inner.db.connection()
    }

    /// The database handle this session was made from: make sibling sessions from it.
    pub fn db(&self) -> &Db {
        &self.inner.db
    }

    /// The primary's pool, with what freshlock keeps of it.
    pub(crate) fn pool(&self) -> &Pool {
        self.inner.db.pool()
    }

    /// Where reads the cache does not have go (see [`reader`](Self::reader)).
    pub(crate) fn reader_pool(&self) -> &Pool {
        self.inner.replica.as_ref().unwrap_or(self.pool())
    }

    /// Where [`Repository::load`](crate::Repository::load) and
    /// [`load_many`](crate::Repository::load_many) read rows the cache does not have: the read
    /// replica given to [`SessionBuilder::read_from`], else [`connection`](Self::connection).
    pub fn reader(&self) -> &DatabaseConnection {
        self.reader_pool().connection()
    }

    /// The lock backend.
    pub fn lock_backend(&self) -> &Arc<dyn LockBackend> {
        &self.inner.lock
    }

    /// The lock policy.
    pub fn policy(&self) -> &LockPolicy {
        &self.inner.policy
    }

    /// Forgets every cached model of every entity.
    pub fn clear_cache(&self) {
        self.inner.map.clear();
    }

    /// The identity map's counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.inner.map.stats()
    }

    /// How many locked sections of this session are running, including those whose caller was
    /// cancelled and which are still rolling back or committing on their own. Wait for 0 before
    /// shutting down to let them finish.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    pub(crate) fn section_started(&self) -> InFlight {
        self.inner.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// The version column declared for entity `entity`, if any.
    pub(crate) fn version_column(&self, entity: TypeId) -> Option<&'static str> {
        self.inner.versions.get(&entity).copied()
    }

    /// The version column declared for entity `E`, if any (declared as one of `E`'s columns, so
    /// always found).
    pub(crate) fn version_of<E: sea_orm::EntityTrait>(&self) -> Option<E::Column> {
        self.version_column(TypeId::of::<E>())
            .and_then(column_named::<E>)
    }

    /// Whether `locked_update` tries the one-statement write first (see
    /// [`SessionBuilder::optimistic_first`]).
    pub(crate) fn optimistic_first(&self) -> bool {
        self.inner.optimistic_first
    }

    /// Whether locked writes carry commit evidence (see [`SessionBuilder::commit_markers`]).
    pub(crate) fn combine_commits(&self) -> bool {
        self.inner.combine_commits
    }

    /// Whether `locked_update` writes in two flights where it can (see
    /// [`SessionBuilder::two_flights`]).
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn two_flights(&self) -> bool {
        self.inner.two_flights
    }

    pub(crate) fn commit_markers(&self) -> bool {
        self.inner.commit_markers
    }

    pub(crate) fn map(&self) -> &IdentityMap {
        &self.inner.map
    }

    pub(crate) fn forget_entity(&self, entity: TypeId) -> usize {
        self.inner.map.remove_type(entity)
    }
}

/// Builds a [`Session`].
#[derive(Debug)]
#[must_use]
pub struct SessionBuilder {
    db: Db,
    lock: Option<Arc<dyn LockBackend>>,
    policy: LockPolicy,
    capacity: Option<usize>,
    versions: HashMap<TypeId, &'static str>,
    /// The first declared version column that is not an integer column.
    invalid_version: Option<(&'static str, &'static str)>,
    commit_markers: Option<bool>,
    optimistic_first: bool,
    combine_commits: bool,
    two_flights: bool,
    replica: Option<Pool>,
}

impl SessionBuilder {
    /// Declares `column` (an integer column) as entity `E`'s version: every `locked_update` write
    /// then checks that it still has the value read and increments it. Without a version column
    /// the write checks the columns it changes (see [`crate::Repository::locked_update`]).
    ///
    /// A column that is not declared as an integer makes [`build`](Self::build) fail with
    /// [`crate::Error::VersionColumn`].
    pub fn version_column<E: EntityTrait>(mut self, column: E::Column) -> Self {
        if !is_integer_column::<E>(&column) {
            self.invalid_version
                .get_or_insert((E::default().table_name(), column.as_str()));
        }
        self.versions.insert(TypeId::of::<E>(), column.as_str());
        self
    }

    crate::setters::setters! {
        /// Uses `lock` (default: the process-wide [`LocalLock::shared`]). Give every session that must
        /// exclude the others the same backend.
        lock(lock: Arc<dyn LockBackend>) => lock = Some(lock);

        /// Uses `policy` (default: [`LockPolicy::default`]).
        policy(policy: LockPolicy) => policy = policy;

        /// Whether locked writes (`locked_update`, `locked_delete`, `get_or_insert`,
        /// `update_or_insert`, [`Session::with_lock`]) carry evidence of their commit, so that a
        /// commit whose reply was lost (the connection broke while `COMMIT` was in flight) is
        /// resolved on another connection: reported as done if it committed, run again only if it
        /// provably did not. Without it such a write returns [`crate::Error::CommitUnknown`] and is
        /// never run again. The evidence is a commit marker (a row in `freshlock_commit`, written in
        /// the write's transaction) on MySQL/MariaDB; on PostgreSQL it is the transaction's id
        /// within the server's incarnation ([`crate::schema::IncarnationMigration`]), returned by
        /// `locked_update`'s own UPDATE: nothing written, no round trip. An id alone is not enough
        /// (one can be handed out again after a crash): a write whose server recovered from a crash
        /// before its lost reply was resolved, and whose id then reads `committed`, returns
        /// [`crate::Error::CommitUnknown`]. See [guarantees](crate::guide::guarantees).
        ///
        /// Default: on for PostgreSQL and MySQL/MariaDB (needs [`crate::schema::CommitMigration`]
        /// and, on PostgreSQL, [`crate::schema::IncarnationMigration`] — without it markers are
        /// written there too; both are part of [`crate::schema::migrations`]), off for
        /// SQLite, whose commits do not cross a network.
        commit_markers(on: bool) => commit_markers = Some(on);

        /// Makes `locked_update` / `locked_update_under` try a **one-statement optimistic write**
        /// first, for entities with a [version column](Self::version_column) whose row this session
        /// has cached: `apply` runs on the cached row, and one `UPDATE … SET <changed columns>,
        /// version = version + 1 WHERE pk AND version = <cached version> RETURNING *` (autocommit;
        /// on MySQL/MariaDB the UPDATE and a read back in one transaction) writes it — the guarded
        /// [`crate::Repository::save`], with no lock, no `BEGIN`, no reload. If the row changed
        /// since it was cached (the version moved), nothing is written and the call goes on as an
        /// ordinary `locked_update` (lock, reload, `apply` again on the fresh row).
        ///
        /// What it covers: every write that bumps the version column — every freshlock write of an
        /// entity with a declared version does — so `apply` may read any column of the cached row,
        /// not only those it sets. A writer outside freshlock that changes the row without bumping
        /// the version is not seen by the guard: do not turn this on if such writers exist.
        /// Without a version column, or without a cached row, or when `apply` changes nothing, the
        /// ordinary locked path runs at once. An optimistic write reports `lock.held == false` and
        /// `lock.tries == 0` (no lock was needed), and, like `save`, a lost reply of its autocommit
        /// UPDATE is [`crate::Error::CommitUnknown`]. Default: off.
        optimistic_first(on: bool) => optimistic_first = on;

        /// Makes `locked_update` / `locked_update_under` **combine commits** on hot rows: the tasks
        /// of this process waiting for the lock of the same row (through sessions on the same
        /// connection pool and lock space — the default process-wide `LocalLock` in whichever session, or
        /// one backend instance — with this setting on) are served by the holder's
        /// transaction instead of each running their own. The holder reloads the row and runs its
        /// `apply`; then each waiter, in arrival order and up to 31 of them, runs *its own* `apply`
        /// (in its own task: closures need not be `'static`) on the row as the ones before it left
        /// it; one guarded UPDATE writes the merged change and one commit makes them all durable.
        /// Every waiter gets its own report, with the committed row and
        /// [`batch`](crate::Report::batch) set to the number of writes the commit carried.
        ///
        /// What is kept: each `apply` still sees every earlier change (nothing is lost), and each
        /// write is reported once. A waiter whose `apply` fails or panics, or that is dropped before
        /// its turn, contributes nothing and gets its own error (the others still commit). A waiter
        /// whose `before_save` / `after_save` hook fails gets its error, and the batch runs again
        /// without it. If the batch is not committed (the holder's own write failed or conflicted for
        /// good), the waiters run on their own, since nothing of theirs was written; if the commit's
        /// outcome is unknown, every member gets [`crate::Error::CommitUnknown`].
        ///
        /// What changes: hooks of the batch run in one transaction, each on its own draft; the
        /// version column (if declared) moves by one per commit, not per write; a batch shares its
        /// fate on a database error. `locked_delete`, `get_or_insert` and `update_or_insert` never
        /// combine. Default: off.
        combine_commits(on: bool) => combine_commits = on;

        /// Makes `locked_update` / `locked_update_under` write in **two round trips**: `BEGIN`
        /// and the reload (`SELECT … FOR UPDATE`) go as one message, the guarded UPDATE and
        /// `COMMIT` as another — on PostgreSQL four round trips become two, on MySQL/MariaDB six
        /// (`SET TRANSACTION`, `BEGIN`, the reload, the marker and the UPDATE, the read back,
        /// `COMMIT`) become two. Across a network, round trips are what a write costs: at 1 ms
        /// each way that is 4 ms instead of 8 or 12, and the row is locked for one round trip
        /// instead of three or more (see BENCHMARKS.md).
        ///
        /// How: freshlock holds a connection of the pool for the write and sends each message
        /// as one text query of several statements, with the values written into it as literals
        /// that read back as the bound values (PostgreSQL: escaped `E'…'::text` strings, so
        /// `standard_conforming_strings` does not matter; MySQL/MariaDB: hexadecimal strings, so
        /// no `sql_mode` does; see the guide's *Topologies*). On PostgreSQL, not behind a
        /// transaction pooler, freshlock's statements there go as `EXECUTE` of statements it
        /// prepares once per connection (the server would plan them on every message; the
        /// first use on a connection logs one "prepared statement does not exist" error). The guarantees are the same: the
        /// same optimistic guard, the same commit evidence (on PostgreSQL the reload reads the
        /// transaction's id; elsewhere a marker rides in the UPDATE's message), so a lost
        /// `COMMIT` reply is resolved; the same retries; a failed statement stops the message,
        /// so its `COMMIT` never runs.
        ///
        /// What changes, and when it falls back:
        /// - **`after_save` runs after the `COMMIT`** (its statements, if any, commit on their
        ///   own), since the `COMMIT` went with the UPDATE; its error is the call's, and the
        ///   write stands (it is not run again). When `before_save` sent a statement, or a value
        ///   cannot be written in (JSON, UUID, decimal, …), the UPDATE goes alone and bound,
        ///   `after_save` runs in the transaction, and `COMMIT` follows.
        /// - It applies under `local` (the default), `pg_advisory` and `row` (their lock tried by
        ///   the reload; when the try fails — the lock is busy — the write goes on as without
        ///   this setting, its lock taken by a statement of its own), combined commits included
        ///   (the served waiters' `after_save` runs after the commit too). The lease backends
        ///   (`table`, `redis`, `mysql_named`), `locked_delete`, `get_or_insert` and
        ///   `update_or_insert` write as before, as does SQLite (no network).
        ///
        /// **Keyed jobs** of workers on such a session take fewer round trips too: `BEGIN` goes
        /// with the take, the completion with the `COMMIT` — a job whose handler sends one
        /// statement is three round trips instead of five (a batch: two plus its handlers'),
        /// the evidence read with the take. A worker's loop
        /// ([`Worker::run`](crate::jobs::Worker::run), `run_until_idle`) sends its next take in
        /// that last message, after the `COMMIT`: two round trips a job (not after a single
        /// keyed job, whose key the worker may follow, nor after a leased claim, nor behind a
        /// transaction pooler). A completion that finds a job asked to stop
        /// ([`jobs::cancel`](crate::jobs::cancel)) is followed in its message by a check that
        /// fails, so the `COMMIT` never runs and the handler's writes roll back, as without
        /// this setting. Handlers get a [`Tx`](crate::Tx) on a connection freshlock holds: it
        /// is a connection as any other (`ConnectionTrait`), but
        /// [`Tx::transaction`](crate::Tx::transaction) is `None`. Leased jobs go the same way:
        /// the claim's UPDATE rides with its `COMMIT`, and a finish sends its completion with the
        /// `COMMIT`, checked against its claim (a finish whose claim is gone rolls back and
        /// reports why, as without this setting) — five round trips per job whose finish sends
        /// one statement, instead of nine.
        ///
        /// Default: off.
        two_flights(on: bool) => two_flights = on;

        /// Reads rows the cache does not have from `replica` (a read replica of the same database:
        /// a PostgreSQL streaming replica, a MariaDB replica): [`Repository::load`](crate::Repository::load),
        /// [`load_many`](crate::Repository::load_many) and the existence check of
        /// [`get_or_insert`](crate::Repository::get_or_insert). What they return is a snapshot, as
        /// every load is — possibly older on a replica that lags.
        ///
        /// Everything that must be current uses the primary (the session's connection):
        /// [`load_fresh`](crate::Repository::load_fresh), the reload under the lock of every locked
        /// write, the guard of [`save`](crate::Repository::save) (checked by the UPDATE on the primary,
        /// so a save based on a stale replica read is [`crate::SaveOutcome::Conflict`], never an
        /// overwrite), every write, lock, claim and section.
        ///
        /// [`build`](Self::build) refuses a replica of another kind of database than the primary.
        read_from(replica: DatabaseConnection) => replica = Some(Pool::new(replica));

        /// Bounds the identity map to `capacity` entries (default: unbounded). When full, caching a
        /// new row evicts an arbitrary other one; 0 disables caching.
        cache_capacity(capacity: usize) => capacity = Some(capacity);
    }

    /// Builds the session.
    ///
    /// # Errors
    /// [`crate::Error::InvalidPolicy`] when the policy cannot work;
    /// [`crate::Error::VersionColumn`] when a declared version column is not an integer column.
    pub fn build(self) -> Result<Session> {
        self.policy.validate()?;
        if let Some(replica) = &self.replica {
            let (primary, replica) = (
                self.db.connection().get_database_backend(),
                replica.get_database_backend(),
            );
            if primary != replica {
                return Err(crate::error::Error::InvalidReplica {
                    primary: format!("{primary:?}"),
                    replica: format!("{replica:?}"),
                });
            }
        }
        if let Some((entity, column)) = self.invalid_version {
            return Err(crate::error::Error::VersionColumn { entity, column });
        }
        Ok(self.build_unchecked())
    }

    pub(crate) fn build_unchecked(self) -> Session {
        let commit_markers = self
            .commit_markers
            .unwrap_or(self.db.connection().get_database_backend() != sea_orm::DbBackend::Sqlite);
        Session {
            inner: Arc::new(Inner {
                db: self.db,
                replica: self.replica,
                map: IdentityMap::new(self.capacity),
                lock: self
                    .lock
                    .unwrap_or_else(|| Arc::new(LocalLock::shared()) as Arc<dyn LockBackend>),
                policy: self.policy,
                commit_markers,
                optimistic_first: self.optimistic_first,
                combine_commits: self.combine_commits,
                two_flights: self.two_flights,
                versions: self.versions,
                in_flight: AtomicUsize::new(0),
            }),
        }
    }
}

/// `E`'s column called `name`.
fn column_named<E: EntityTrait>(name: &str) -> Option<E::Column> {
    E::Column::iter().find(|column| column.as_str() == name)
}

/// Whether `column` of `E` is declared as an integer column (what a version column must be).
fn is_integer_column<E: EntityTrait>(column: &E::Column) -> bool {
    matches!(
        column.def().get_column_type(),
        ColumnType::TinyInteger
            | ColumnType::SmallInteger
            | ColumnType::Integer
            | ColumnType::BigInteger
            | ColumnType::TinyUnsigned
            | ColumnType::SmallUnsigned
            | ColumnType::Unsigned
            | ColumnType::BigUnsigned
    )
}
