//! Leases in a table of the application's own database (`freshlock_lock`).

use std::time::Duration;

use async_trait::async_trait;
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbErr};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::{
    LocalLock,
    backoff::Backoff,
    floor, holder,
    lease::{Held, LOCK_LEASES, lease_free, lease_values},
    lease_row::{Grant, Holder, LOCKS},
    name::LockName,
    sql::{lock_error, statement},
    traits::{Acquired, Fencing, LeaseCheck, LeaseLock, LockGuard, Renewal},
};
use crate::{
    db::deadline::{reply_bound, within},
    db::failure::in_doubt,
    db::{autocommit::autocommit, pool::Pool},
    error::LockError,
    schema::{LOCK_TABLE, MAX_STORED_NAME},
};

const KIND: &str = "table";

/// A lease lock in the `freshlock_lock` table of the database the data lives in (SQLite,
/// PostgreSQL, MySQL/MariaDB): it holds across processes and machines.
///
/// Acquire is one atomic statement on SQLite and PostgreSQL when the name is free (insert the
/// row or take the released one, returning the new fence); a held name costs a second statement
/// that takes the row over only if its holder's lease has expired (logged as "stale lock taken
/// over"). MySQL, without `RETURNING`, uses up to three single-row statements and a read.
/// Expiry uses the **database clock** only. Each name's fence keeps growing: a name's first row
/// starts one above the fence floor, a grant whose key turned out not to exist deletes its row
/// only when that row has no history above the floor, and [`crate::inspect::compact`] raises
/// the floor past every row it deletes (see [`crate::schema`]). A holder that dies keeps the
/// lease until its TTL runs out; `locked_update` checks, in the transaction of its write, that the
/// lease is still its own and unexpired. On PostgreSQL the grants of freshlock's own writes
/// and sections ([`LeaseLock::acquire_checked`]) commit without waiting for their log flush:
/// the write that checks the lease makes it durable, and a grant a crash lost fails that check
/// (`LeaseLost`); a lease taken with [`LeaseLock::acquire`] is flushed before it is returned.
///
/// Needs [`crate::schema::Migration`]. Cheap to clone.
#[derive(Clone, Debug)]
pub struct TableLock {
    db: Pool,
    label: Option<String>,
    /// This backend's in-process queue (see [`LockBackend::queue`]), shared by its clones.
    queue: LocalLock,
}

impl TableLock {
    /// Leases in `db`'s `freshlock_lock` table.
    pub fn new(db: impl Into<crate::database::Db>) -> Self {
        Self {
            db: db.into().pool().clone(),
            label: None,
            queue: LocalLock::new(),
        }
    }

    /// Records `label` (a worker or task name) as the holder's label, for the lock inspector.
    pub fn with_label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// [`LeaseLock::acquire`]; `durable`: the grant's commit waits for its log flush.
    async fn acquire_with(
        &self,
        name: &LockName,
        wait: Duration,
        ttl: Duration,
        durable: bool,
    ) -> Acquired {
        let stored = name.bounded(MAX_STORED_NAME, false).into_owned();
        let deadline = Instant::now() + wait;
        let mut backoff = Backoff::new();
        loop {
            // A grant on a connection that died while idle in the pool fails at once: it is
            // released by its token in the background like any lost grant (`try_once`), and
            // asked again under a new token on another connection (`live`).
            let (this, key) = (self, stored.as_str());
            let tried = crate::db::live::on_live_connection(&self.db, || async move {
                let token = holder::new_token();
                let grant = this.try_once(key, &token, ttl, durable).await?;
                Ok(grant.map(|grant| (grant, token)))
            })
            .await
            .map_err(|e| lock_error(KIND, LOCK_TABLE, e))?;
            if let Some((Grant { fence, taken_over }, token)) = tried {
                if taken_over {
                    warn!(lock = %name, fence, "stale lock taken over: the previous holder's lease had expired");
                    crate::metrics::stale_lock_taken_over(KIND);
                } else {
                    debug!(lock = %name, fence, "table lease taken");
                }
                return Ok(Some(Box::new(TableGuard {
                    db: self.db.clone(),
                    name: stored,
                    token,
                    fence,
                    released: false,
                    lease_ends: tokio::time::Instant::now() + ttl,
                })));
            }
            if !backoff.wait_until(deadline).await {
                return Ok(None);
            }
        }
    }

    /// One try: the new fence when the lease was taken, and whether it was taken over from a
    /// holder whose lease had expired (a free row is tried first, so a takeover is visible).
    /// Each statement is its own transaction; the rare deadlock InnoDB still reports on one of
    /// MySQL's single-row statements is a busy try.
    async fn try_once(
        &self,
        name: &str,
        token: &str,
        ttl: Duration,
        durable: bool,
    ) -> Result<Option<Grant>, DbErr> {
        let holder = Holder {
            token,
            ttl,
            label: self.label.as_deref(),
            durable,
        };
        let db = autocommit(&self.db);
        let grant = LOCKS.grant(&db, name, &holder, true);
        within(reply_bound(ttl), grant).await.inspect_err(|e| {
            if in_doubt(e) {
                self.resolve_lost_grant(name, token, ttl);
            }
        })
    }

    /// A grant whose reply was lost (the connection broke while it was in flight) may have
    /// taken the lease — for a token nobody would hold, keeping the name until its TTL. Like an
    /// in-doubt write it is resolved by its token: the token is in the row, or it is not. A
    /// release by that token (in the background, retried while the database is unreachable, as
    /// a held lease's) frees the row if the grant happened and matches nothing if it did not.
    fn resolve_lost_grant(&self, name: &str, token: &str, ttl: Duration) {
        warn!(lock = %name, "the lease grant's reply was lost: releasing by its token");
        drop(TableGuard {
            db: self.db.clone(),
            name: name.to_owned(),
            token: token.to_owned(),
            fence: 0,
            released: false,
            lease_ends: tokio::time::Instant::now() + ttl,
        });
    }
}

super::outside::outside_backend!(TableLock, Table, Lease);

#[async_trait]
impl LeaseLock for TableLock {
    async fn acquire(&self, name: &LockName, wait: Duration, ttl: Duration) -> Acquired {
        self.acquire_with(name, wait, ttl, true).await
    }

    /// On PostgreSQL the grant's commit does not wait for its log flush (a commit that waits
    /// costs a flush, ~1 ms here, as much as the write it guards): see
    /// [`LeaseLock::acquire_checked`] for why nothing is lost by that.
    async fn acquire_checked(&self, name: &LockName, wait: Duration, ttl: Duration) -> Acquired {
        self.acquire_with(name, wait, ttl, false).await
    }
}

/// A lease in `freshlock_lock`.
#[derive(Debug)]
struct TableGuard {
    db: Pool,
    name: String,
    token: String,
    fence: i64,
    released: bool,
    /// When the lease runs out by itself (this process's clock, only to bound the retries of a
    /// failed release).
    lease_ends: tokio::time::Instant,
}

impl TableGuard {
    /// This grant's lease (see `lease.rs`).
    fn held(&self) -> Held<'_> {
        Held {
            key: self.name.clone().into(),
            owner: &self.token,
            fence: Some(self.fence),
        }
    }

    async fn release_now(db: &Pool, name: &str, token: &str) -> Result<(), LockError> {
        let backend = db.get_database_backend();
        let sql = format!(
            "UPDATE {LOCK_TABLE} SET owner = NULL, expires_at = 0 WHERE name = ? AND owner = ?"
        );
        let db = autocommit(db);
        let release = db.execute_raw(statement(backend, &sql, vec![name.into(), token.into()]));
        within(crate::db::deadline::DEFAULT_REPLY, release)
            .await
            .map_err(|e| lock_error(KIND, LOCK_TABLE, e))?;
        Ok(())
    }
}

#[async_trait]
impl LockGuard for TableGuard {
    fn fencing(&self) -> Option<&dyn Fencing> {
        Some(self)
    }

    fn renewal(&self) -> Option<&dyn Renewal> {
        Some(self)
    }

    fn released_by_commit(mut self: Box<Self>) {
        self.released = true;
    }

    async fn release(mut self: Box<Self>) -> Result<(), LockError> {
        self.released = true;
        let released = Self::release_now(&self.db, &self.name, &self.token).await;
        if released.is_err() {
            self.release_in_background();
        }
        released
    }

    async fn retire(self: Box<Self>) -> Result<(), LockError> {
        let backend = self.db.get_database_backend();
        let delete = floor::retire_sql("owner = ?");
        let values = vec![self.name.clone().into(), self.token.clone().into()];
        let db = autocommit(&self.db);
        let retire = db.execute_raw(statement(backend, &delete, values));
        match within(crate::db::deadline::DEFAULT_REPLY, retire).await {
            Ok(done) if done.rows_affected() == 1 => {
                let mut this = self;
                this.released = true;
                debug!(lock = %this.name, "lease row of a missing key deleted");
                Ok(())
            }
            // The row has history above the floor (or the delete failed): keep it, release.
            Ok(_) | Err(_) => self.release().await,
        }
    }
}

#[async_trait]
impl Fencing for TableGuard {
    fn fence(&self) -> u64 {
        u64::try_from(self.fence).unwrap_or_default()
    }

    fn owned_row(&self) -> Option<(&str, &str)> {
        Some((&self.name, &self.token))
    }

    async fn verify(&self, txn: &DatabaseTransaction) -> Result<bool, LockError> {
        // FOR UPDATE: a takeover of this row waits until our transaction ends, so the lease
        // cannot be lost between this check and the commit (see `lease.rs`).
        (LOCK_LEASES.check(txn, &self.held()).await).map_err(|e| lock_error(KIND, LOCK_TABLE, e))
    }

    /// One UPDATE that checks the grant (as [`verify`](Fencing::verify)) and frees the row; it
    /// keeps the row locked until `txn` ends, so a takeover waits for the commit and then finds
    /// the name free (or, after a rollback, still ours).
    async fn verify_and_release_in(
        &self,
        txn: &DatabaseTransaction,
    ) -> Result<LeaseCheck, LockError> {
        let backend = txn.get_database_backend();
        let sql = lease_free(backend);
        let values = lease_values(&self.name, &self.token, self.fence).to_vec();
        let updated = txn
            .execute_raw(statement(backend, &sql, values))
            .await
            .map_err(|e| lock_error(KIND, LOCK_TABLE, e))?;
        Ok(if updated.rows_affected() == 1 {
            LeaseCheck::HeldReleasedByCommit
        } else {
            LeaseCheck::Lost
        })
    }
}

#[async_trait]
impl Renewal for TableGuard {
    async fn extend(&self, ttl: Duration) -> Result<bool, LockError> {
        let db = autocommit(&self.db);
        let held = self.held();
        let extend = LOCK_LEASES.extend(&db, &held, ttl);
        (within(reply_bound(ttl), extend).await).map_err(|e| lock_error(KIND, LOCK_TABLE, e))
    }
}

impl TableGuard {
    /// Releases the lease from a task of its own, trying again (20 ms doubling to 500 ms) while
    /// the database is unreachable, until the lease would have run out anyway: when the database
    /// comes back after a restart, the lease's key is free within a retry, not after its TTL.
    fn release_in_background(&self) {
        let (db, name, token) = (self.db.clone(), self.name.clone(), self.token.clone());
        let lease_ends = self.lease_ends;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            warn!(lock = %name, "lease dropped outside a runtime; it runs out by its TTL");
            return;
        };
        runtime.spawn(async move {
            let mut delay = Duration::from_millis(20);
            loop {
                match Self::release_now(&db, &name, &token).await {
                    Ok(()) => {
                        debug!(lock = %name, "lease released in the background");
                        return;
                    }
                    Err(error) if tokio::time::Instant::now() + delay >= lease_ends => {
                        warn!(lock = %name, %error, "background release failed; the lease runs out by its TTL");
                        return;
                    }
                    Err(_) => {
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_millis(500));
                    }
                }
            }
        });
    }
}

impl Drop for TableGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        // No async drop: release in the background when a runtime is there (retrying while the
        // database is unreachable); otherwise the lease runs out by its TTL.
        self.release_in_background();
    }
}
