//! A locked section's transaction ([`Tx`]); the repositories bound to it are in
//! `tx_repository.rs` ([`TxRepository`]).
//!
//! Inside [`crate::Session::with_lock`], a [`crate::Section`] or
//! [`crate::Repository::locked_update_with`], the work is given a `&Tx`: the section's one
//! transaction. It is a sea-orm connection (`ConnectionTrait`), so plain sea-orm queries run
//! through it, and [`Tx::repository`] gives repositories whose every read and write goes through
//! it too — no second connection of the pool (a one-connection pool works), no read outside the
//! transaction.
//!
//! What those repositories write reaches the session's cache only when the section commits: the
//! stored rows replace the cached ones, deleted rows are evicted. A section that rolls back leaves
//! the cache as it was.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
};

use async_trait::async_trait;
use sea_orm::{
    ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, ExecResult, QueryResult, Statement,
};

use crate::{
    db::{deadline::Bounded, txn::Txn},
    erased::Erased,
    identity_map::{Change, Key},
    session::Session,
};

/// How a locking read treats a row another transaction has locked.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForUpdate {
    /// Wait for it (`FOR UPDATE`), bounded by the database's lock wait timeout.
    #[default]
    Wait,
    /// Fail at once (`FOR UPDATE NOWAIT`): a transient [`Error::Database`](crate::Error::Database) (PostgreSQL 55P03,
    /// MySQL 3572), so the caller can move on or try again later. The read runs in a savepoint,
    /// so the failure does not abort the section's transaction.
    NoWait,
    /// Leave it out (`FOR UPDATE SKIP LOCKED`): a locked row reads as missing, so a worker takes
    /// the next free row instead of queueing behind another worker's.
    SkipLocked,
}

/// A locked section's transaction.
///
/// Inside [`crate::Session::with_lock`], a [`crate::Section`] or
/// [`crate::Repository::locked_update_with`], the work is given a `&Tx`: the section's one
/// transaction. It is a sea-orm connection (`ConnectionTrait`), so plain sea-orm queries run
/// through it, and [`Tx::repository`] gives repositories whose every read and write goes through
/// it too — no second connection of the pool (a one-connection pool works), no read outside the
/// transaction.
///
/// On SQLite the section's transaction is `BEGIN IMMEDIATE`: it is the only writer of the whole
/// database while it runs, so rows need no locking and the [`ForUpdate`] modes read as plain
/// reads (nothing is ever locked by another transaction there).
pub struct Tx {
    pub(crate) txn: Txn,
    pub(crate) session: Session,
    /// Rows this transaction read or wrote, by cache key: the snapshots of its guarded saves.
    seen: Mutex<HashMap<Key, Erased>>,
    /// What the commit does to the session's cache, in order.
    effects: Mutex<Vec<Change>>,
    /// Whether a guarded write of this attempt was refused (a retrying section runs again).
    conflicted: AtomicBool,
}

impl std::fmt::Debug for Tx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("backend", &self.txn.get_database_backend())
            .finish_non_exhaustive()
    }
}

impl Tx {
    /// The bound on each reply of the database in this section (see `deadline.rs`).
    pub(crate) fn reply(&self) -> std::time::Duration {
        self.session.policy().reply_deadline()
    }

    /// The transaction, each round trip bounded by [`Self::reply`].
    pub(crate) fn bounded(&self) -> Bounded<'_, Txn> {
        Bounded::new(&self.txn, self.reply())
    }

    pub(crate) fn new(txn: impl Into<Txn>, session: Session) -> Self {
        Self {
            txn: txn.into(),
            session,
            seen: Mutex::default(),
            effects: Mutex::default(),
            conflicted: AtomicBool::new(false),
        }
    }

    /// The sea-orm transaction itself (for APIs that want a `DatabaseTransaction`, such as
    /// savepoints with `begin`); `None` for a keyed job's handler on a session with
    /// [`two_flights`](crate::SessionBuilder::two_flights), whose transaction runs on a
    /// connection freshlock holds (the `Tx` is its connection: `ConnectionTrait`).
    pub fn transaction(&self) -> Option<&DatabaseTransaction> {
        self.txn.sea()
    }

    /// The session the section belongs to.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The transaction, the cache changes to make if it commits, and whether a guarded write
    /// was refused.
    pub(crate) fn into_parts(self) -> (Txn, Vec<Change>, bool) {
        let effects = self
            .effects
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        (self.txn, effects, self.conflicted.into_inner())
    }

    /// Records that a guarded write was refused in this attempt.
    pub(crate) fn note_conflict(&self) {
        self.conflicted.store(true, Ordering::SeqCst);
    }

    /// `model` is what the row holds now in this transaction; with `cache`, the commit caches it.
    pub(crate) fn seen<M: Send + Sync + 'static>(&self, key: &Key, model: &Arc<M>, cache: bool) {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone(), Erased::new(Arc::clone(model)));
        if cache {
            self.effect(Change::cache(key.clone(), Arc::clone(model)));
        }
    }

    /// The row is gone (or unknown) in this transaction; the commit evicts it.
    pub(crate) fn gone(&self, key: &Key) {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
        self.effect(Change::Evict(key.clone()));
    }

    pub(crate) fn effect(&self, effect: Change) {
        self.effects
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(effect);
    }

    /// The snapshot of a row for a guarded save: as this transaction last saw it, else as the
    /// session has it cached.
    pub(crate) fn snapshot<M: Send + Sync + 'static>(&self, key: &Key) -> Option<Arc<M>> {
        let seen = self
            .seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .cloned();
        match seen {
            Some(model) => model.get::<M>(),
            None => self.session.map().get::<M>(key),
        }
    }
}

// Each statement waits at most the policy's reply bound (see `deadline.rs`).
#[async_trait]
impl ConnectionTrait for Tx {
    fn get_database_backend(&self) -> DbBackend {
        self.txn.get_database_backend()
    }

    async fn execute_raw(&self, stmt: Statement) -> std::result::Result<ExecResult, DbErr> {
        self.bounded().execute_raw(stmt).await
    }

    async fn execute_unprepared(&self, sql: &str) -> std::result::Result<ExecResult, DbErr> {
        self.bounded().execute_unprepared(sql).await
    }

    async fn query_one_raw(
        &self,
        stmt: Statement,
    ) -> std::result::Result<Option<QueryResult>, DbErr> {
        self.bounded().query_one_raw(stmt).await
    }

    async fn query_all_raw(&self, stmt: Statement) -> std::result::Result<Vec<QueryResult>, DbErr> {
        self.bounded().query_all_raw(stmt).await
    }

    fn support_returning(&self) -> bool {
        self.txn.support_returning()
    }

    fn is_mock_connection(&self) -> bool {
        self.txn.is_mock_connection()
    }
}
