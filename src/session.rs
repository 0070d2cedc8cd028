//! A unit of work: connection, identity map, lock backend and lock policy.

use std::{
    any::TypeId,
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use sea_orm::{DatabaseConnection, EntityTrait, IdenStatic};

use crate::{
    error::Result,
    identity_map::{CacheStats, IdentityMap},
    lock::{LocalLock, LockBackend, LockPolicy},
    repository::Repository,
};

/// One unit of work (a job, a worker, a request): the database connection, an identity map, a
/// lock backend and a lock policy.
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
    db: DatabaseConnection,
    map: IdentityMap,
    lock: Arc<dyn LockBackend>,
    policy: LockPolicy,
    versions: HashMap<TypeId, &'static str>,
    commit_markers: bool,
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
    /// A session on `db` with the process-wide in-process lock, the default [`LockPolicy`] and an
    /// unbounded identity map.
    pub fn new(db: DatabaseConnection) -> Self {
        Self::builder(db).build_unchecked()
    }

    /// A builder to choose the lock backend, the policy and the cache bound.
    pub fn builder(db: DatabaseConnection) -> SessionBuilder {
        SessionBuilder {
            db,
            lock: None,
            policy: LockPolicy::default(),
            capacity: None,
            versions: HashMap::new(),
            invalid_version: None,
            commit_markers: None,
        }
    }

    /// The repository of entity `E`. Any sea-orm entity works; nothing needs to be implemented.
    pub fn repository<E: EntityTrait>(&self) -> Repository<E> {
        Repository::new(self.clone())
    }

    /// The database connection.
    pub fn connection(&self) -> &DatabaseConnection {
        &self.inner.db
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

    /// Whether locked writes write a commit marker (see [`SessionBuilder::commit_markers`]).
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
    db: DatabaseConnection,
    lock: Option<Arc<dyn LockBackend>>,
    policy: LockPolicy,
    capacity: Option<usize>,
    versions: HashMap<TypeId, &'static str>,
    /// The first declared version column that is not an integer column.
    invalid_version: Option<(&'static str, &'static str)>,
    commit_markers: Option<bool>,
}

impl SessionBuilder {
    /// Declares `column` (an integer column) as entity `E`'s version: every `locked_update` write
    /// then checks that it still has the value read and increments it. Without a version column
    /// the write checks the columns it changes (see [`crate::Repository::locked_update`]).
    ///
    /// A column that is not declared as an integer makes [`build`](Self::build) fail with
    /// [`crate::Error::VersionColumn`].
    pub fn version_column<E: EntityTrait>(mut self, column: E::Column) -> Self {
        if !crate::write::is_integer_column::<E>(&column) {
            self.invalid_version
                .get_or_insert((E::default().table_name(), column.as_str()));
        }
        self.versions.insert(TypeId::of::<E>(), column.as_str());
        self
    }

    /// Uses `lock` (default: the process-wide [`LocalLock::shared`]). Give every session that must
    /// exclude the others the same backend.
    pub fn lock(mut self, lock: Arc<dyn LockBackend>) -> Self {
        self.lock = Some(lock);
        self
    }

    /// Uses `policy` (default: [`LockPolicy::default`]).
    pub fn policy(mut self, policy: LockPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Whether locked writes (`locked_update`, `locked_delete`, `get_or_insert`,
    /// `update_or_insert`, [`Session::locked`]) insert a commit marker into `freshlock_commit`
    /// in their transaction, so that a commit whose reply was lost (the connection broke while
    /// `COMMIT` was in flight) is resolved on another connection: reported as done if it
    /// committed, run again only if it provably did not. Without markers such a write returns
    /// [`crate::Error::CommitUnknown`] and is never run again.
    ///
    /// Default: on for PostgreSQL and MySQL/MariaDB (needs
    /// [`crate::schema::CommitMigration`], part of [`crate::schema::migrations`]), off for
    /// SQLite, whose commits do not cross a network.
    pub fn commit_markers(mut self, on: bool) -> Self {
        self.commit_markers = Some(on);
        self
    }

    /// Bounds the identity map to `capacity` entries (default: unbounded). When full, caching a
    /// new row evicts an arbitrary other one; 0 disables caching.
    pub fn cache_capacity(mut self, capacity: usize) -> Self {
        self.capacity = Some(capacity);
        self
    }

    /// Builds the session.
    ///
    /// # Errors
    /// [`crate::Error::InvalidPolicy`] when the policy cannot work;
    /// [`crate::Error::VersionColumn`] when a declared version column is not an integer column.
    pub fn build(self) -> Result<Session> {
        self.policy.validate()?;
        if let Some((entity, column)) = self.invalid_version {
            return Err(crate::Error::VersionColumn { entity, column });
        }
        Ok(self.build_unchecked())
    }

    pub(crate) fn build_unchecked(self) -> Session {
        let commit_markers = self
            .commit_markers
            .unwrap_or(self.db.get_database_backend() != sea_orm::DbBackend::Sqlite);
        Session {
            inner: Arc::new(Inner {
                db: self.db,
                map: IdentityMap::new(self.capacity),
                lock: self
                    .lock
                    .unwrap_or_else(|| Arc::new(LocalLock::shared()) as Arc<dyn LockBackend>),
                policy: self.policy,
                commit_markers,
                versions: self.versions,
                in_flight: AtomicUsize::new(0),
            }),
        }
    }
}
