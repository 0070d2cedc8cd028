//! Resolving a lost commit reply from the write's evidence, on other connections of its pool.

use std::time::Duration;

use sea_orm::{
    ConnectionTrait, DbBackend, DbErr, Statement,
    sea_query::{ExprTrait, Query},
};
use tracing::{info, warn};

use super::{evidence::Evidence, marker::Marker};
use crate::{
    db::{autocommit::autocommit, failure::classify, pool::Pool},
    error::Error,
    schema::{COMMIT_TABLE, INCARNATION_TABLE},
};

/// How long a lost commit reply is resolved for (the database may be restarting) before the
/// outcome is reported as unknown.
pub(crate) const RESOLVE_WITHIN: Duration = Duration::from_secs(30);

/// What a lost commit reply turned out to be.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Resolution {
    /// The write committed.
    Committed,
    /// The write did not commit and never will: running it again is safe.
    Absent,
}

impl Marker {
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

/// A write whose outcome could not be resolved.
pub(super) fn unknown(target: &str, source: crate::error::BoxError) -> Error {
    Error::CommitUnknown {
        target: target.to_owned(),
        source,
    }
}

impl Evidence {
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
