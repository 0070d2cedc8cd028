//! Commits whose reply was lost: never applied twice.
//!
//! When the connection breaks while `COMMIT` is in flight, the transaction may or may not have
//! committed, and running the write again would apply it twice if it had. So every locked write
//! carries **evidence** of its commit ([`Evidence`]), and a lost reply is resolved on another
//! connection with it.
//!
//! **A commit marker** (MySQL/MariaDB; PostgreSQL without `freshlock_incarnation`): a row with a
//! token no other write has, inserted into `freshlock_commit` in the write's own transaction,
//! just before `COMMIT`. It is resolved by inserting the *same* token:
//!
//! - the insert fails on the key and the row is the writer's → the write committed: report it;
//! - the insert succeeds → the write did not commit, and now never can (its own insert of the
//!   token would fail): it is provably absent and safe to run again. The resolver's row is
//!   marked as its own (`created_at = 0`), because its insert can lose its reply too: a retried
//!   resolution that finds its own row knows the write is absent, not committed;
//! - while the old transaction is still finishing on the server, the insert waits for it (a
//!   unique-key check waits for the transaction that inserted the same key, on PostgreSQL,
//!   InnoDB and SQLite alike), so the answer is never read too early.
//!
//! A marker is one short INSERT in the transaction that commits anyway (no extra flush);
//! markers older than [`KEEP_MARKERS`] are deleted now and then by the writers themselves. A
//! marker row is durable exactly when the write is: it is in the same transaction, so crash
//! recovery keeps both or neither. On PostgreSQL it rides in the guarded UPDATE's own statement
//! (a data-modifying CTE): no round trip, but a second row, index entry and later deletion per
//! write (7–14 % of a `locked_update`'s rate, BENCHMARKS.md §7).
//!
//! **The transaction id within a server incarnation** (PostgreSQL with `freshlock_incarnation`):
//! `txid_current()`, returned by the guarded UPDATE beside the row (or one `SELECT` before the
//! commit of a section), resolved by `txid_status` — waiting while the transaction is still in
//! progress. The id alone is not evidence: a transaction whose WAL never reached disk before a
//! crash leaves no trace of its id, and after crash recovery the server hands the same id to a
//! new transaction — once that one commits, `txid_status` says `committed` for a write that never
//! was (measured: 8 of 8 tries after a `kill -9` of a backend). Ids are given out twice only
//! across crash recovery (or a failover to a standby), and those empty every `UNLOGGED` table.
//! So the server's incarnation is the token in `freshlock_incarnation`'s one row, an `UNLOGGED`
//! table (`schema::IncarnationMigration`): a pool sees the token (`Pool::incarnation`) before it
//! begins the write, hence before the id is given out; the resolution asks `txid_status` in the
//! same statement that checks the token is still there — then no crash recovery happened since
//! the id was given out, and the answer is this write's. With the token gone only `committed`
//! is ambiguous (the id may be another transaction's): [`Error::CommitUnknown`], never a guess;
//! `aborted` or an id "in the future" still prove the write absent (see `try_resolve_xid`). A
//! write that finds the table empty (new, or just emptied by crash recovery) carries a marker
//! instead and starts the new incarnation.
//!
//! If the database does not answer within [`RESOLVE_WITHIN`], the outcome stays unknown and the
//! caller gets [`Error::CommitUnknown`] — never a second `apply`.
//!
//! Why a token rather than the version column or the lease's fence: both can be moved on by a
//! later writer (an ABA: version v+1 may be someone else's write from v when ours did not
//! commit), so they cannot prove that *this* write committed. A token can.

use std::{sync::Arc, time::Duration};

use sea_orm::{
    ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, Statement,
    sea_query::{ExprTrait, Query},
};
use tracing::{debug, info, warn};

use crate::{
    db::deadline::within,
    db::failure::{classify, in_doubt},
    db::{
        autocommit::{alone, autocommit, read_committed, upkeep},
        pool::{Incarnation, Pool},
    },
    error::{Error, database},
    lock::holder,
    schema::{COMMIT_TABLE, INCARNATION_TABLE},
};

/// How long a lost commit reply is resolved for (the database may be restarting) before the
/// outcome is reported as unknown.
pub(crate) const RESOLVE_WITHIN: Duration = Duration::from_secs(30);

/// How long markers are kept: far longer than any resolution takes.
pub(crate) const KEEP_MARKERS: Duration = Duration::from_secs(600);

/// Every this many markers a process writes, it deletes the expired ones.
const SWEEP_EVERY: u64 = 1024;

/// Most old markers one sweep deletes (on PostgreSQL and MySQL/MariaDB): twice the markers a
/// process writes between two of its sweeps, so the sweeps keep up.
const SWEEP_AT_MOST: u64 = 2 * SWEEP_EVERY;

/// What a lost commit reply turned out to be.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Resolution {
    /// The write committed.
    Committed,
    /// The write did not commit and never will: running it again is safe.
    Absent,
}

/// One write's commit marker.
#[derive(Debug)]
pub(crate) struct Marker {
    token: String,
}

impl Marker {
    pub(crate) fn new() -> Self {
        Self {
            token: holder::new_token(),
        }
    }

    /// The marker's INSERT: the writer's, stamped with the database clock, or the resolver's
    /// (`created_at = 0`).
    pub(crate) fn insert(
        &self,
        backend: sea_orm::DbBackend,
        writer: bool,
    ) -> sea_orm::sea_query::InsertStatement {
        let now = if writer {
            crate::lock::sql::now_ms(backend)
        } else {
            "0"
        };
        Query::insert()
            .into_table(sea_orm::sea_query::Alias::new(COMMIT_TABLE))
            .columns([
                sea_orm::sea_query::Alias::new("token"),
                sea_orm::sea_query::Alias::new("created_at"),
            ])
            // Two columns, two values: `values_panic` cannot panic here.
            .values_panic([
                self.token.clone().into(),
                sea_orm::sea_query::Expr::cust(now),
            ])
            .to_owned()
    }

    /// Writes the marker in the write's transaction, just before its `COMMIT`.
    pub(crate) async fn write(&self, txn: &DatabaseTransaction) -> Result<(), DbErr> {
        txn.execute(&self.insert(txn.get_database_backend(), true))
            .await
            .map(drop)
    }

    /// One try at resolving a lost reply with this marker, on `db`.
    async fn try_resolve(&self, db: &Pool, target: &str) -> Try {
        let insert = self.insert(db.get_database_backend(), false);
        match autocommit(db).execute(&insert).await {
            Ok(_) => {
                info!(target, token = %self.token, "lost commit reply: the write did not commit; running it again");
                Try::Answer(Resolution::Absent)
            }
            Err(e) if crate::db::failure::is_unique_violation(&e) => {
                match self.written_by_writer(db).await {
                    Ok(Some(true)) => {
                        info!(target, token = %self.token, "lost commit reply: the write committed");
                        Try::Answer(Resolution::Committed)
                    }
                    Ok(Some(false)) => {
                        info!(target, token = %self.token, "lost commit reply: the write did not commit (found our own resolution)");
                        Try::Answer(Resolution::Absent)
                    }
                    // Gone since the insert failed: only our own resolution's row can be
                    // swept that soon (a writer's is minutes younger than the sweep's
                    // cutoff), so try again.
                    Ok(None) => Try::Again("the marker was swept meanwhile".into()),
                    Err(e) => Try::Again(Box::new(e)),
                }
            }
            Err(e) if classify(&e).is_transient() => Try::Again(Box::new(e)),
            Err(e) => Try::Unknown(Box::new(e)),
        }
    }
}

/// The evidence a write's lost commit reply is resolved with (see the module docs).
#[derive(Debug)]
pub(crate) enum Evidence {
    /// A marker row written in the write's transaction.
    Marker(Marker),
    /// PostgreSQL with `freshlock_incarnation`: the write's transaction id, and the token of the
    /// server incarnation that gave it out (known to the pool before the write, or read by it).
    Xid {
        /// `txid_current()` of the write's transaction (with its epoch: never wraps).
        xid: i64,
        /// The incarnation token seen before the transaction's id was given out.
        incarnation: Arc<str>,
    },
}

/// The transaction's id and the incarnation's token (`NULL` when the table is empty), as
/// columns `freshlock_xid` and `freshlock_incarnation`. Also the expressions that
/// `locked_update`'s UPDATE returns beside the row.
const XID_AND_INCARNATION: [&str; 2] = [
    "txid_current() AS freshlock_xid",
    "(SELECT token FROM freshlock_incarnation WHERE id = 1) AS freshlock_incarnation",
];

/// How a write's own statement carries the evidence of its commit: the one place where a write
/// learns whether it returns its transaction id or writes a marker. Row steps (the guarded
/// UPDATE), keyed jobs (their completion) and the evidence taken before a section's `COMMIT`
/// ([`Evidence::take`]) all ask it.
pub(crate) enum Plan {
    /// The statement returns the transaction id (and the incarnation token when the pool has
    /// not seen it lately): [`Stamped::exprs`], then [`Stamped::evidence`] from the row.
    Stamped(Stamped),
    /// A marker row, in the same transaction (not PostgreSQL, or no `freshlock_incarnation`).
    Marker,
}

impl Plan {
    /// The plan of a write in `txn` on `db` (asking `txn`, never another connection of the
    /// pool, whether `freshlock_incarnation` exists: see [`Pool::incarnation`]).
    pub(crate) async fn of(db: &Pool, txn: &DatabaseTransaction) -> Self {
        match db.incarnation(txn).await {
            Incarnation::Known(token) => Self::Stamped(Stamped { known: Some(token) }),
            Incarnation::Unseen => Self::Stamped(Stamped { known: None }),
            Incarnation::Unsupported => Self::Marker,
        }
    }
}

/// A write whose statement returns its transaction id (see [`Plan::Stamped`]).
pub(crate) struct Stamped {
    /// The incarnation token the pool saw lately; `None`: the statement reads it too.
    known: Option<Arc<str>>,
}

impl Stamped {
    /// The expressions the statement returns beside its rows: the transaction id, and the
    /// incarnation's token too when the pool has not seen it lately.
    pub(crate) fn exprs(&self) -> &'static [&'static str] {
        &XID_AND_INCARNATION[..if self.known.is_none() { 2 } else { 1 }]
    }

    /// The evidence of the statement that returned [`exprs`](Self::exprs) in `row`, in `txn`
    /// on `db`.
    pub(crate) async fn evidence(
        self,
        txn: &DatabaseTransaction,
        db: &Pool,
        row: &sea_orm::QueryResult,
    ) -> Result<Evidence, DbErr> {
        let (xid, seen) = Evidence::read(row, self.known.is_none())?;
        Evidence::stamped(txn, db, xid, self.known, seen).await
    }
}

impl Evidence {
    /// Takes the evidence in `txn` (a transaction on `db`), just before its `COMMIT`: on
    /// PostgreSQL with `freshlock_incarnation`, one SELECT of the transaction's id and the
    /// incarnation's token, which writes nothing; elsewhere a marker row.
    ///
    /// The token a pool knows may have been seen after this transaction got its id (another
    /// write refreshed it meanwhile). That is still sound: the token was in the table before
    /// this SELECT, which runs on the transaction's own connection; a crash since the id was
    /// given out would have ended that connection (so no evidence, no commit), and a crash after
    /// this SELECT empties the table of the token (so the resolution does not trust `committed`).
    pub(crate) async fn take(txn: &DatabaseTransaction, db: &Pool) -> Result<Self, DbErr> {
        let stamped = match Plan::of(db, txn).await {
            Plan::Stamped(stamped) => stamped,
            Plan::Marker => {
                let marker = Marker::new();
                marker.write(txn).await?;
                return Ok(Self::Marker(marker));
            }
        };
        let select = format!("SELECT {}", stamped.exprs().join(", "));
        let row = txn
            .query_one_raw(Statement::from_string(DbBackend::Postgres, select))
            .await?
            .ok_or_else(|| DbErr::Custom("SELECT txid_current() returned no row".into()))?;
        stamped.evidence(txn, db, &row).await
    }

    /// The transaction id and (with `incarnation`) the incarnation token of a row that returned
    /// [`Stamped::exprs`].
    fn read(row: &sea_orm::QueryResult, incarnation: bool) -> Result<(i64, Option<String>), DbErr> {
        let xid = row.try_get::<i64>("", "freshlock_xid")?;
        if !incarnation {
            return Ok((xid, None));
        }
        Ok((
            xid,
            row.try_get::<Option<String>>("", "freshlock_incarnation")?,
        ))
    }

    /// The evidence of a transaction on `db` with id `xid`, begun while the incarnation
    /// `known` was the server's (see `Pool::incarnation`), or (without `known`) that read the
    /// incarnation `seen` itself. When it saw none (the table was just made, or crash recovery
    /// emptied it), the transaction id proves nothing: the write gets a marker instead, and
    /// starts the new incarnation, in `txn`.
    async fn stamped(
        txn: &DatabaseTransaction,
        db: &Pool,
        xid: i64,
        known: Option<Arc<str>>,
        seen: Option<String>,
    ) -> Result<Self, DbErr> {
        if let Some(incarnation) = known {
            return Ok(Self::Xid { xid, incarnation });
        }
        if let Some(seen) = seen {
            db.saw_incarnation(&seen);
            return Ok(Self::Xid {
                xid,
                incarnation: seen.into(),
            });
        }
        let marker = Marker::new();
        marker.write(txn).await?;
        let token = holder::new_token();
        info!(%token, "freshlock_incarnation is empty (new, or emptied by crash recovery): starting a new incarnation");
        txn.execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            format!(
                "INSERT INTO {INCARNATION_TABLE} (id, token) VALUES (1, $1) ON CONFLICT (id) DO NOTHING"
            ),
            [token.into()],
        ))
        .await?;
        Ok(Self::Marker(marker))
    }

    /// After a lost commit reply: whether the write committed, asked on other connections of
    /// `db`.
    ///
    /// # Errors
    /// [`Error::CommitUnknown`] when no answer could be had within [`RESOLVE_WITHIN`], or the
    /// evidence cannot answer (the server recovered from a crash since the write began).
    /// Each try waits at most `reply` (a resolver's connection can be cut off too): one
    /// without an answer is tried again on another connection, until [`RESOLVE_WITHIN`].
    pub(crate) async fn resolve(
        &self,
        db: &Pool,
        target: &str,
        reply: Duration,
    ) -> Result<Resolution, Error> {
        let deadline = tokio::time::Instant::now() + RESOLVE_WITHIN;
        let mut delay = Duration::from_millis(20);
        loop {
            let attempt = deadline.min(tokio::time::Instant::now() + reply);
            let tried = match self {
                Self::Marker(marker) => {
                    tokio::time::timeout_at(attempt, marker.try_resolve(db, target)).await
                }
                Self::Xid { xid, incarnation } => {
                    let tried = try_resolve_xid(db, target, *xid, incarnation.as_ref());
                    tokio::time::timeout_at(attempt, tried).await
                }
            };
            let error = match tried {
                Ok(Try::Answer(resolution)) => return Ok(resolution),
                Ok(Try::Again(error)) => error,
                Ok(Try::Unknown(error)) => return Err(unknown(target, error)),
                Err(_) if attempt < deadline => Box::new(crate::db::failure::no_reply(reply)),
                Err(_) => return Err(unknown(target, "no answer from the database".into())),
            };
            warn!(target, %error, "lost commit reply: no answer yet");
            if tokio::time::Instant::now() + delay >= deadline {
                return Err(unknown(target, error));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(250));
        }
    }
}

/// One try at resolving a lost reply.
enum Try {
    /// The outcome.
    Answer(Resolution),
    /// No answer yet (the database is not answering, or the transaction is still running).
    Again(crate::error::BoxError),
    /// The outcome cannot be known.
    Unknown(crate::error::BoxError),
}

/// One try at resolving the commit of transaction `xid`, begun while `incarnation` was the
/// server's: `txid_status(xid)` and whether the incarnation still is, in one statement.
///
/// - Same incarnation: no crash recovery since the id was given out, so the status is this
///   write's: `committed`, `aborted` (run it again), `in progress` (ask again).
/// - Incarnation gone (crash recovery, a promoted standby, or the table emptied by hand): the id
///   may have been given out again. Only `committed` is then ambiguous (this write's durable
///   commit, or another transaction's) → unknown. Every other answer proves this write is not
///   committed here and never will be: a durable commit of it would be in the WAL, and replaying
///   it keeps the id taken and its status `committed`; its session did not survive a crash.
///   So `aborted` → absent, and an id "in the future" (not given out since recovery) → absent.
///   `in progress` there is another transaction's, or (table emptied by hand, no crash) maybe
///   this one's → unknown, not waited for.
async fn try_resolve_xid(db: &Pool, target: &str, xid: i64, incarnation: &str) -> Try {
    let select = Statement::from_sql_and_values(
        DbBackend::Postgres,
        format!(
            "SELECT EXISTS (SELECT 1 FROM {INCARNATION_TABLE} WHERE id = 1 AND token = $1) AS same, \
             txid_status($2) AS status"
        ),
        [incarnation.into(), xid.into()],
    );
    let row = match autocommit(db).query_one_raw(select).await {
        Ok(Some(row)) => row,
        Ok(None) => return Try::Unknown("the resolution returned no row".into()),
        Err(e) if crate::db::failure::is_future_xid(&e) => {
            db.forget_incarnation();
            info!(
                target,
                xid,
                "lost commit reply: the server recovered and never gave out the write's \
                 transaction id again: it did not commit; running it again"
            );
            return Try::Answer(Resolution::Absent);
        }
        Err(e) if classify(&e).is_transient() => return Try::Again(Box::new(e)),
        Err(e) => return Try::Unknown(Box::new(e)),
    };
    let answer = row
        .try_get::<bool>("", "same")
        .and_then(|same| Ok((same, row.try_get::<Option<String>>("", "status")?)));
    let (same, status) = match answer {
        Ok(answer) => answer,
        Err(e) => return Try::Unknown(Box::new(e)),
    };
    if !same {
        db.forget_incarnation();
    }
    match (same, status.as_deref()) {
        (true, Some("committed")) => {
            info!(target, xid, "lost commit reply: the write committed");
            Try::Answer(Resolution::Committed)
        }
        (_, Some("aborted")) => {
            info!(
                target,
                xid,
                same_incarnation = same,
                "lost commit reply: the write did not commit; running it again"
            );
            Try::Answer(Resolution::Absent)
        }
        (true, Some("in progress")) => {
            Try::Again(format!("transaction {xid} is still in progress").into())
        }
        (false, Some("committed" | "in progress")) => Try::Unknown(
            "the server recovered from a crash since the write began, and its transaction id \
             may have been given to another transaction"
                .into(),
        ),
        (_, None) => Try::Unknown(format!("transaction {xid} is too old to be looked up").into()),
        (_, Some(other)) => Try::Unknown(format!("txid_status answered {other:?}").into()),
    }
}

/// The error of a write that may have reached the database without a marker (an autocommit
/// statement, a commit without marker): [`Error::CommitUnknown`] when the connection was lost
/// while it was in flight, else [`Error::Database`].
pub(crate) fn write_error(operation: &'static str, target: &str, e: DbErr) -> Error {
    if in_doubt(&e) {
        unknown(target, Box::new(e))
    } else {
        database(operation, &target, e)
    }
}

impl Marker {
    /// Whether the marker row is the writer's, not an earlier resolution's; `None` when there
    /// is no row (any more).
    async fn written_by_writer(&self, db: &Pool) -> Result<Option<bool>, DbErr> {
        let select = Query::select()
            .column(sea_orm::sea_query::Alias::new("created_at"))
            .from(sea_orm::sea_query::Alias::new(COMMIT_TABLE))
            .and_where(ExprTrait::eq(
                sea_orm::sea_query::Expr::col(sea_orm::sea_query::Alias::new("token")),
                self.token.as_str(),
            ))
            .to_owned();
        let Some(row) = autocommit(db).query_one(&select).await? else {
            return Ok(None);
        };
        Ok(Some(row.try_get::<i64>("", "created_at")? != 0))
    }
}

fn unknown(target: &str, source: crate::error::BoxError) -> Error {
    Error::CommitUnknown {
        target: target.to_owned(),
        source,
    }
}

/// Commits the transaction of a write. With `markers`, it first takes the evidence of its commit
/// ([`Evidence::take`]: the transaction id on PostgreSQL, a commit marker elsewhere), so a lost
/// reply is resolved (see the module docs); without, a lost reply is [`Error::CommitUnknown`].
///
/// Each round trip waits at most `reply` (see `deadline.rs`).
///
/// # Errors
/// As [`commit`]; [`Error::Database`] when the evidence cannot be taken (rolled back, nothing
/// committed — a missing `freshlock_commit` table means freshlock's migrations were not run).
pub(crate) async fn commit_write(
    txn: DatabaseTransaction,
    markers: bool,
    db: &Pool,
    target: &str,
    reply: Duration,
) -> Result<(), Error> {
    if !markers {
        return within(reply, txn.commit())
            .await
            .map_err(|e| write_error("committing", target, e));
    }
    let evidence = match within(reply, Evidence::take(&txn, db)).await {
        Ok(evidence) => evidence,
        Err(e) => {
            rollback_after(txn, reply, crate::db::failure::is_no_reply(&e)).await;
            return Err(database("marking the commit of", &target, e));
        }
    };
    commit(txn, &evidence, db, target, reply).await
}

/// Ends `txn` after a failure: rolled back as [`rollback`] does, or — when `silent`, a round
/// trip on it got no reply ([`Error::is_no_reply`]) — dropped at once (which queues the
/// rollback on its connection): a second round trip on a connection gone silent would only
/// wait out another bound.
pub(crate) async fn rollback_after(txn: DatabaseTransaction, reply: Duration, silent: bool) {
    if silent {
        debug!("no reply on the transaction's connection: dropped, not rolled back");
        drop(txn);
    } else {
        rollback(txn, reply).await;
    }
}

/// Rolls `txn` back, waiting at most `reply` (a connection whose reply does not come is dropped,
/// which queues the rollback on it). A failure is logged: the server ends the transaction with
/// the connection anyway.
pub(crate) async fn rollback(txn: DatabaseTransaction, reply: Duration) {
    if let Err(error) = within(reply, txn.rollback()).await {
        warn!(%error, "rollback failed");
    }
}

/// Commits `txn` (which holds `evidence`): `Ok` when it committed — also when the reply was lost
/// and the evidence shows the commit happened. For writes that take the evidence themselves (on
/// PostgreSQL, in the guarded UPDATE's own statement: one round trip less).
///
/// # Errors
/// - A transient [`Error::Database`] when the commit provably did not happen (run the write
///   again), or failed before it was sent.
/// - [`Error::CommitUnknown`] when the outcome cannot be resolved.
pub(crate) async fn commit(
    txn: DatabaseTransaction,
    evidence: &Evidence,
    db: &Pool,
    target: &str,
    reply: Duration,
) -> Result<(), Error> {
    // A reply that does not come within `reply` is a lost one (see `deadline.rs`).
    let lost = match within(reply, txn.commit()).await {
        Ok(()) => {
            if let Evidence::Marker(marker) = evidence {
                sweep(db, marker, reply).await;
            }
            return Ok(());
        }
        Err(e) if in_doubt(&e) => e,
        Err(e) => return Err(database("committing", &target, e)),
    };
    warn!(target, error = %lost, "the commit's reply was lost: resolving on another connection");
    match evidence.resolve(db, target, reply).await? {
        Resolution::Committed => Ok(()),
        // The lost connection, as it is: transient, so the write runs again.
        Resolution::Absent => Err(database("committing", &target, lost)),
    }
}

/// Now and then (every [`SWEEP_EVERY`] markers written on the pool) deletes the markers older than
/// [`KEEP_MARKERS`]. A failure is logged: it only leaves rows for the next sweep. The write
/// that runs it still holds its locks, so the sweep waits at most `reply` (a reply's bound, see
/// `deadline.rs`): a reply that never comes must not freeze the write's key.
async fn sweep(db: &Pool, marker: &Marker, reply: Duration) {
    if !db.marker_written().is_multiple_of(SWEEP_EVERY) {
        return;
    }
    if let Err(error) = within(reply, delete_old_markers(db)).await {
        warn!(%error, token = %marker.token, "deleting old commit markers failed");
    }
}

/// Deletes up to [`SWEEP_AT_MOST`] markers older than [`KEEP_MARKERS`], oldest first (on the
/// age index, `schema::MarkerAgeMigration`), passing over any that a transaction still holds:
/// a write in flight, or one whose `COMMIT` reply a silent partition lost, whose transaction
/// stays open until the server drops its connection. A `DELETE` that found its rows itself
/// waited for such a marker — for `innodb_lock_wait_timeout` (50 s) on MySQL/MariaDB, where it
/// also reads past the oldest young marker — and the writer running the sweep with it; at
/// REPEATABLE READ its gap locks held up every other writer's marker insert meanwhile. Returns
/// how many it deleted.
async fn delete_old_markers(db: &Pool) -> Result<u64, DbErr> {
    let backend = db.get_database_backend();
    let now = crate::lock::sql::now_ms(backend);
    let keep = KEEP_MARKERS.as_millis();
    let old = format!(
        "SELECT token FROM {COMMIT_TABLE} WHERE created_at < {now} - {keep} \
         ORDER BY created_at LIMIT {SWEEP_AT_MOST}"
    );
    let sql = match backend {
        // SQLite has one writer: nothing to pass over.
        DbBackend::Sqlite => {
            format!("DELETE FROM {COMMIT_TABLE} WHERE created_at < {now} - {keep}")
        }
        DbBackend::Postgres => {
            format!("DELETE FROM {COMMIT_TABLE} WHERE token IN ({old} FOR UPDATE SKIP LOCKED)")
        }
        // MySQL cannot read the table it deletes from in a subquery: the markers are locked
        // first (READ COMMITTED: no gap locks), then deleted by key, in one transaction.
        _ => {
            return alone(db, read_committed(), |txn| {
                Box::pin(async move {
                    let lock =
                        Statement::from_string(backend, format!("{old} FOR UPDATE SKIP LOCKED"));
                    let tokens = (txn.query_all_raw(lock).await?.iter())
                        .map(|row| row.try_get::<String>("", "token").map(sea_orm::Value::from))
                        .collect::<Result<Vec<_>, _>>()?;
                    if tokens.is_empty() {
                        return Ok(0);
                    }
                    let placeholders = vec!["?"; tokens.len()].join(", ");
                    let sql = format!("DELETE FROM {COMMIT_TABLE} WHERE token IN ({placeholders})");
                    let done = txn
                        .execute_raw(Statement::from_sql_and_values(backend, sql, tokens))
                        .await?;
                    Ok(done.rows_affected())
                })
            })
            .await;
        }
    };
    upkeep(db, Statement::from_string(backend, sql)).await
}
