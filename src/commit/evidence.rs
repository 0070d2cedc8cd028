//! The evidence a write's lost commit reply is resolved with, and how a write's statement
//! carries it (`Plan`).

use std::sync::Arc;

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Statement};
use tracing::info;

use super::marker::Marker;
use crate::{
    db::pool::{Incarnation, Pool},
    lock::holder,
    schema::INCARNATION_TABLE,
};

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
    pub(crate) async fn of(db: &Pool, txn: &impl ConnectionTrait) -> Self {
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
        txn: &impl ConnectionTrait,
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
    pub(crate) async fn take(txn: &impl ConnectionTrait, db: &Pool) -> Result<Self, DbErr> {
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
        txn: &impl ConnectionTrait,
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
}
