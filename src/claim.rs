//! Claim / finish with a lease: the Django report's new → processing → done, without its
//! stranded rows.
//!
//! The report marks a row "processing" in a short transaction, does the heavy work with no
//! transaction open, then marks it "done". If the worker dies after "processing", the retry sees
//! "processing" and returns: the row is stranded forever. Here a claim is a lease (database
//! clock): once it has expired, the work can be claimed again, and the dead worker's late
//! `finish` is refused because the claim is no longer its own. Work that may outlast its lease
//! beats with [`Claims::extend`].
//!
//! Claims live in freshlock's own table, `freshlock_claim` (one row per claimed key), rather than
//! in columns of your entity: any entity works unchanged, a claim can cover work that is not one
//! row, and the lease bookkeeping (owner token, fence, expiry, holder) stays out of your schema.
//! Keep your own state column if you want one, and update it in the same transaction as the
//! finish with [`Claims::finish_with`].
//!
//! A claim or finish whose `COMMIT` reply is lost is resolved like a locked write's (see
//! [`crate::SessionBuilder::commit_markers`]): each commits with evidence (a commit marker; the
//! transaction id within the server incarnation on PostgreSQL), so the outcome
//! is read back on another connection — `Claimed` / `Finished` when it committed, a transient
//! error (nothing was written: call again) when it provably did not, and
//! [`Error::CommitUnknown`] when the database did not answer in time. A claim is never left held
//! by a token nobody knows, and a finish that happened is never reported as `Stale`.

use std::{future::Future, pin::Pin, time::Duration};

use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend};

use crate::{
    commit::commit_write,
    db::{
        autocommit::{autocommit, read_committed},
        deadline::{Bounded, DEFAULT_REPLY, within},
        own::{Own, rollback, rollback_after},
        pool::Pool,
    },
    error::{ApplyError, Error, Result, work_error},
    lock::{
        LockName, holder,
        lease::{CLAIM_LEASES, Held},
        lease_row::{CLAIMS, Holder},
        sql::{millis, now_ms, statement},
    },
    schema::{CLAIM_TABLE, MAX_STORED_NAME},
};

/// Claims on keys (`"spam:17"`), in `db`'s `freshlock_claim` table. Cheap to clone.
///
/// [`claim`](Self::claim) takes a key under a lease (database clock), [`extend`](Self::extend)
/// moves the lease on while the work runs, [`finish`](Self::finish) marks it done only while the
/// claim is still this worker's. A lost `COMMIT` reply of a claim or a finish is resolved by its
/// commit evidence: see the [module docs](self).
#[derive(Clone, Debug)]
pub struct Claims {
    db: Pool,
    label: Option<String>,
    markers: bool,
    /// The bound on each round trip (see [`Claims::with_reply_timeout`]).
    reply: Duration,
}

/// A claim this worker holds: pass it to [`Claims::finish`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    name: String,
    token: String,
    /// Grows with every claim of the same key.
    pub fence: u64,
}

/// What [`Claims::claim`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimOutcome {
    /// The work is ours: do it, then [`Claims::finish`].
    Claimed(Claim),
    /// Somebody finished it already (a duplicate delivery).
    Done,
    /// Somebody holds a live claim (its lease has not expired).
    Busy,
}

/// What [`Claims::finish`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FinishOutcome {
    /// Marked done.
    Finished,
    /// The claim is no longer ours (it expired and was claimed again, or was finished): nothing
    /// was changed.
    Stale,
}

impl Claim {
    /// This claim's lease (see `lock/lease.rs`).
    fn held(&self) -> Held<'_> {
        Held {
            key: self.name.clone().into(),
            owner: &self.token,
            fence: Some(i64::try_from(self.fence).unwrap_or(i64::MAX)),
        }
    }
}

fn database(operation: &'static str, name: &str, e: sea_orm::DbErr) -> Error {
    crate::error::database(operation, &name, e)
}

impl Claims {
    /// Claims in `db` (needs [`crate::schema::ClaimMigration`], part of [`crate::schema::migrations`]).
    ///
    /// Commit markers (see the module docs) are on for PostgreSQL and MySQL/MariaDB and off for
    /// SQLite, as for sessions; they need [`crate::schema::CommitMigration`] too.
    pub fn new(db: impl Into<crate::database::Db>) -> Self {
        let db = db.into().pool().clone();
        let markers = db.get_database_backend() != DbBackend::Sqlite;
        Self {
            db,
            label: None,
            markers,
            reply: DEFAULT_REPLY,
        }
    }

    crate::setters::setters! {
        /// Whether claims and finishes commit with a commit marker, so that a lost `COMMIT` reply
        /// is resolved (see the module docs). Without, a lost reply is [`Error::CommitUnknown`].
        commit_markers(on: bool) => markers = on;

        /// Sets how long one reply of the database may take (10 s by default): a round trip of a
        /// claim or a finish — `BEGIN`, a statement, the commit, a rollback, each statement of
        /// [`finish_with`](Self::finish_with)'s work — whose reply does not come within it fails
        /// the call as a lost connection does, instead of waiting on a silent partition for TCP to
        /// give up (hours). A commit cut so is resolved by its evidence (see the type's docs).
        ///
        /// A zero bound could not wait for any reply: calls then fail with
        /// [`Error::InvalidPolicy`] before sending anything.
        with_reply_timeout(bound: Duration) => reply = bound;

        /// Records `label` as the claimant's label.
        with_label(label: impl Into<String>) => label = Some(label.into());
    }

    /// Claims `key` for `lease`, unless it is done or claimed by a live claim. One short
    /// transaction (one statement in it, two or three on MySQL, plus the commit marker); no
    /// transaction stays open. Each round trip waits at most the reply timeout (10 s unless
    /// [`with_reply_timeout`](Self::with_reply_timeout) says otherwise): one whose reply never
    /// comes (a silent partition) fails the call as transient, as a lost connection does.
    ///
    /// # Errors
    /// - [`Error::InvalidPolicy`] when the reply timeout is zero; nothing is written.
    /// - [`Error::InvalidLease`] when `lease` is shorter than a millisecond (the lease would have
    ///   run out when it was granted, and a second worker would claim the same work); nothing is
    ///   written.
    /// - [`Error::Database`] when the database fails; when
    ///   [`is_transient`](Error::is_transient), nothing was claimed and the call can be made
    ///   again.
    /// - [`Error::CommitUnknown`] when the commit's reply was lost and could not be resolved.
    pub async fn claim(&self, key: &LockName, lease: Duration) -> Result<ClaimOutcome> {
        if millis(lease) < 1 {
            return Err(Error::InvalidLease { lease });
        }
        self.check()?;
        let name = key.bounded(MAX_STORED_NAME, false).into_owned();
        let token = holder::new_token();
        let fail = |e| database("claiming", &name, e);
        // A deadlock of two claimants of one new key (InnoDB) is run again by `Own::open`.
        let (txn, taken) = (self.own())
            .open(|txn| {
                let (name, token, label) = (name.clone(), token.clone(), self.label.clone());
                Box::pin(async move {
                    let holder = Holder {
                        token: &token,
                        ttl: lease,
                        label: label.as_deref(),
                        durable: true,
                    };
                    let grant = CLAIMS.grant(txn, &name, &holder, false).await?;
                    Ok(grant.map(|g| g.fence))
                })
            })
            .await
            .map_err(fail)?;
        if let Some(fence) = taken {
            commit_write(txn, self.markers, &self.db, &name, self.reply).await?;
            return Ok(ClaimOutcome::Claimed(Claim {
                name,
                token,
                fence: u64::try_from(fence).unwrap_or(0),
            }));
        }
        let backend = txn.get_database_backend();
        let read = format!("SELECT state FROM {CLAIM_TABLE} WHERE name = ?");
        let row = self
            .bounded(&txn)
            .query_one_raw(statement(backend, &read, vec![name.clone().into()]))
            .await;
        let state = row
            .and_then(|row| row.map(|r| r.try_get::<String>("", "state")).transpose())
            .map_err(fail);
        // Nothing was written: end the transaction either way.
        match &state {
            Ok(_) => rollback(txn, self.reply).await,
            Err(e) => rollback_after(txn, self.reply, e.is_no_reply()).await,
        }
        let state = state?;
        Ok(match state.as_deref() {
            Some("done") => ClaimOutcome::Done,
            _ => ClaimOutcome::Busy,
        })
    }

    /// [`Error::InvalidPolicy`] when the reply timeout could not wait for any reply.
    fn check(&self) -> Result<()> {
        if self.reply.is_zero() {
            return Err(Error::InvalidPolicy {
                reason: "reply_timeout must be longer than zero",
            });
        }
        Ok(())
    }

    /// A claim's transaction of its own (`db::own`: `BEGIN` on a live connection and never cut
    /// in half, each round trip bounded by the reply timeout, a deadlock run again): READ
    /// COMMITTED on MySQL/MariaDB, where REPEATABLE READ would gap-lock a missing key on the
    /// first statement and deadlock two claimants inserting it.
    fn own(&self) -> Own<'_> {
        let own = Own::new(&self.db, self.reply);
        match self.db.get_database_backend() {
            DbBackend::MySql => own.with(read_committed()),
            _ => own,
        }
    }

    /// A claim's transaction, each of its round trips bounded by the reply timeout.
    fn bounded<'t>(&self, txn: &'t DatabaseTransaction) -> Bounded<'t, DatabaseTransaction> {
        Bounded::new(txn, self.reply)
    }

    /// Moves `claim`'s lease to run out `lease` from now (database clock), while the claim is
    /// still this worker's: a heartbeat for work that may outlast the lease it was claimed with
    /// (beat every third of the lease, say). One statement that commits alone; its round trip
    /// waits at most the reply timeout.
    ///
    /// `false` when the claim is no longer ours — its lease ran out and another worker claimed
    /// the work, or it was finished: stop, the finish would be [`FinishOutcome::Stale`]. A claim
    /// whose lease ran out but that nobody claimed again is still ours, and is extended.
    ///
    /// # Errors
    /// - [`Error::InvalidLease`] when `lease` is shorter than a millisecond, and
    ///   [`Error::InvalidPolicy`] when the reply timeout is zero; nothing is written.
    /// - [`Error::Database`] when the database fails (transient when it is): whether the lease
    ///   moved is then unknown; beat again.
    pub async fn extend(&self, claim: &Claim, lease: Duration) -> Result<bool> {
        if millis(lease) < 1 {
            return Err(Error::InvalidLease { lease });
        }
        self.check()?;
        let db = autocommit(&self.db);
        let held = claim.held();
        let extended = CLAIM_LEASES.extend(&db, &held, lease);
        (within(self.reply, extended).await).map_err(|e| database("extending", &claim.name, e))
    }

    /// Marks the claimed work done, only while the claim is still this worker's.
    ///
    /// # Errors
    /// [`Error::Database`] when the database fails; when [`is_transient`](Error::is_transient),
    /// nothing was written and the claim is still this worker's: call again.
    /// [`Error::CommitUnknown`] when the commit's reply was lost and could not be resolved.
    /// [`Error::InvalidPolicy`] when the reply timeout is zero (nothing is written).
    pub async fn finish(&self, claim: &Claim) -> Result<FinishOutcome> {
        let (txn, outcome) = self.mark_done(claim).await?;
        self.end(txn, outcome, &claim.name).await
    }

    /// Begins a finish's transaction and marks `claim` done in it (rolled back on failure).
    async fn mark_done(&self, claim: &Claim) -> Result<(DatabaseTransaction, FinishOutcome)> {
        self.check()?;
        (self.own())
            .open(|txn| {
                let claim = claim.clone();
                Box::pin(async move { mark_done(txn, &claim).await })
            })
            .await
            .map_err(|e| database("finishing", &claim.name, e))
    }

    /// Commits a finish that marked the claim done (with a marker), or rolls back one that
    /// found it stale (nothing to commit).
    async fn end(
        &self,
        txn: DatabaseTransaction,
        outcome: FinishOutcome,
        name: &str,
    ) -> Result<FinishOutcome> {
        if outcome == FinishOutcome::Stale {
            rollback(txn, self.reply).await;
            return Ok(outcome);
        }
        commit_write(txn, self.markers, &self.db, name, self.reply).await?;
        Ok(outcome)
    }

    /// Like [`finish`](Self::finish), and runs `also` in the same transaction when the claim is
    /// still ours (to set your own state column, store the result…): both commit, or neither.
    ///
    /// `also` gets the claim's transaction as a [`Bounded`] connection: each of its round trips
    /// waits at most the reply timeout, as the claim's own do, so a reply that never comes
    /// fails the finish (transient: call again) instead of freezing it. Write through it as
    /// through the transaction (`active_model.update(txn)`, `Entity::find().one(txn)`);
    /// [`Bounded::inner`] is the transaction itself, with no bound.
    ///
    /// # Errors
    /// As [`finish`](Self::finish) (`also`'s writes commit or not with the claim's). When `also`
    /// fails, nothing is committed and the claim stays held: a database error it returns (a
    /// `sea_orm::DbErr`, one that went without reply included) comes back as
    /// [`Error::Database`], transient when the finish can be made again, a freshlock
    /// [`Error`] as it is, and any other error as [`Error::FinishAborted`].
    pub async fn finish_with<F>(&self, claim: &Claim, also: F) -> Result<FinishOutcome>
    where
        F: for<'t> FnOnce(
            &'t Bounded<'t, DatabaseTransaction>,
        )
            -> Pin<Box<dyn Future<Output = Result<(), ApplyError>> + Send + 't>>,
    {
        let (txn, outcome) = self.mark_done(claim).await?;
        if outcome == FinishOutcome::Finished {
            let work = self.bounded(&txn);
            if let Err(error) = also(&work).await {
                let silent = work.went_silent();
                rollback_after(txn, self.reply, silent).await;
                return Err(work_error("finishing", &claim.name, error, |source| {
                    Error::FinishAborted {
                        claim: claim.name.clone(),
                        source,
                    }
                }));
            }
        }
        self.end(txn, outcome, &claim.name).await
    }
}

async fn mark_done(
    txn: &impl ConnectionTrait,
    claim: &Claim,
) -> std::result::Result<FinishOutcome, sea_orm::DbErr> {
    let backend = txn.get_database_backend();
    let now = now_ms(backend);
    let held = CLAIM_LEASES.held(backend);
    let sql = format!(
        "UPDATE {CLAIM_TABLE} SET state = 'done', owner = NULL, finished_at = {now} WHERE {held}"
    );
    let values = CLAIM_LEASES.values(&claim.held());
    let done = txn.execute_raw(statement(backend, &sql, values)).await?;
    Ok(if done.rows_affected() == 1 {
        FinishOutcome::Finished
    } else {
        FinishOutcome::Stale
    })
}
