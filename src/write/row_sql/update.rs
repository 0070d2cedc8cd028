//! The guarded UPDATE that returns the row as the database stores it, with the evidence of
//! its commit in the same statement where the database allows (see `commit`), and on
//! MySQL/MariaDB in one message with its marker (and a lease's check).

use std::time::Duration;

use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, FromQueryResult,
    IntoActiveModel, Iterable, QueryFilter, QueryResult, QueryTrait, Value,
    sea_query::{
        Alias, CommonTableExpression, Expr, InsertStatement, Query, UpdateStatement, WithClause,
        WithQuery,
    },
};

use super::columns::ColumnValue;
#[cfg(feature = "mysql")]
use crate::write::row::select_by_key;
use crate::{
    commit::{Evidence, Marker, Plan, Stamped},
    db::deadline::within,
    db::pool::Pool,
};
#[cfg(feature = "mysql")]
use sea_orm::ModelTrait;

/// `column = value`, or `column IS NULL` for a NULL value.
pub(super) fn holds<E: EntityTrait>(column: E::Column, value: &Value) -> sea_orm::Condition {
    let condition = if *value == value.as_null() {
        column.is_null()
    } else {
        column.eq(value.clone())
    };
    sea_orm::Condition::all().add(condition)
}

/// `UPDATE … SET <changes> WHERE pk = <original's pk> AND <each expected column holds its value>`, one
/// statement, returning the row as the database stored it (`RETURNING` on PostgreSQL and SQLite;
/// on MySQL/MariaDB a read by primary key after the UPDATE, which is only the same row when `db`
/// is a transaction). `None` when no row matched: the row is gone, or the guard refused.
pub(crate) async fn update_returning<E, C>(
    db: &C,
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
) -> Result<Option<E::Model>, DbErr>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
    C: ConnectionTrait,
{
    match guarded_update::<E>(original, changes, expected)?
        .exec(db)
        .await
    {
        Ok(model) => Ok(Some(model)),
        Err(DbErr::RecordNotUpdated) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Which step of [`update_with_evidence`] failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Taking the commit evidence (a marker's INSERT, the new incarnation's).
    Evidence,
    /// The guarded UPDATE.
    Update,
    /// The check-and-free of a held lease sent in the UPDATE's message (see
    /// [`update_with_evidence`]'s `lease`) did not confirm the lease: it was lost, or the UPDATE
    /// found no row, and the message's count of rows cannot tell which. Nothing is to be kept:
    /// the attempt is run again with the lease checked by a statement of its own.
    Lease,
}

/// How [`update_with_evidence`] sends a locked write's UPDATE.
pub(crate) struct Sending<'a> {
    /// The session's pool (the evidence's checks of the server incarnation use it).
    pub(crate) db: &'a Pool,
    /// Whether the commit's evidence is taken (the session's `commit_markers`).
    pub(crate) markers: bool,
    /// The bound on each round trip.
    pub(crate) reply: Duration,
    /// MySQL/MariaDB only, with `markers`: the values of a held `table` lease's check-and-free
    /// ([`crate::lock::lease::lease_free`]: name, owner token, fence), sent first in the marker's
    /// and the UPDATE's message — or, where that message cannot be written, as a statement of
    /// its own before them. The caller has not checked the lease; a write returned then found
    /// it held, and its transaction frees it.
    pub(crate) lease: Option<[Value; 3]>,
}

/// The guarded UPDATE of a locked write (as [`update_returning`]), with the evidence of its
/// commit when `sending.markers` asks for it, taken in the fewest round trips the database
/// allows (see `commit/`): on PostgreSQL the UPDATE returns its transaction id (and the server
/// incarnation's token when the pool has not seen it lately), or writes a marker in its own
/// statement without `freshlock_incarnation`; on MySQL/MariaDB a marker's INSERT goes with the
/// UPDATE as one message where their values can be written into its text
/// ([`marked_update_mysql`]), with a lease's check-and-free first when there is one; elsewhere
/// a marker's INSERT goes first. Each round trip waits at most `sending.reply`.
///
/// # Errors
/// The failed step and its error; the transaction is to be rolled back.
pub(crate) async fn update_with_evidence<E, C>(
    txn: &C,
    sending: Sending<'_>,
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
) -> Result<(Option<E::Model>, Option<Evidence>), (Step, DbErr)>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
    C: ConnectionTrait,
{
    let Sending {
        db,
        markers,
        reply,
        lease,
    } = sending;
    let update = || {
        within(
            reply,
            update_returning::<E, _>(txn, original, changes, expected),
        )
    };
    let stamped = |stamp| {
        let update = update_returning_stamped::<E, _>(txn, original, changes, expected, stamp);
        within(reply, update)
    };
    fn updated<T>(row: Result<T, DbErr>) -> Result<T, (Step, DbErr)> {
        row.map_err(|e| (Step::Update, e))
    }
    let backend = txn.get_database_backend();
    if lease.is_some() && (!markers || backend != DbBackend::MySql) {
        // Not asked for by the row step (see `Locking::riding_write`): checked on its own then.
        let e = format!(
            "a lease checked in the UPDATE's message needs MySQL/MariaDB and commit markers, not {backend:?}"
        );
        return Err((Step::Lease, DbErr::Custom(e)));
    }
    if !markers {
        return Ok((updated(update().await)?, None));
    }
    #[cfg(feature = "mysql")]
    if backend == DbBackend::MySql {
        let marked = marked_update_mysql::<E, _>(txn, original, changes, expected, reply, &lease);
        if let Some(done) = marked.await {
            return done;
        }
        // Not written into one message: the lease is checked (and freed) by a statement of
        // its own first, the marker and the UPDATE follow bound. A failed statement is the
        // write's failure, classified (and retried) as an UPDATE's would be.
        if let Some(lease) = lease {
            match within(reply, free_lease(txn, lease)).await {
                Ok(true) => {}
                Ok(false) => {
                    let e = DbErr::Custom("the lease was lost before the write".into());
                    return Err((Step::Lease, e));
                }
                Err(e) => return Err((Step::Update, e)),
            }
        }
    }
    if backend != DbBackend::Postgres {
        let marker = Marker::new();
        within(reply, marker.write(txn))
            .await
            .map_err(|e| (Step::Evidence, e))?;
        return Ok((updated(update().await)?, Some(Evidence::Marker(marker))));
    }
    let stamp = match Plan::of(db, txn).await {
        Plan::Stamped(stamped) => stamped,
        Plan::Marker => {
            let marker = Marker::new();
            let insert = Box::new(marker.insert(DbBackend::Postgres, true));
            let stored = stamped(Stamp::Marker(insert)).await;
            let stored = updated(stored.map(|row| row.map(|(stored, _)| stored)))?;
            return Ok((stored, Some(Evidence::Marker(marker))));
        }
    };
    match updated(stamped(Stamp::Xid(&stamp)).await)? {
        Some((stored, row)) => {
            let evidence = within(reply, stamp.evidence(txn, db, &row))
                .await
                .map_err(|e| (Step::Evidence, e))?;
            Ok((Some(stored), Some(evidence)))
        }
        None => Ok((None, None)),
    }
}

/// [`update_with_evidence`] on MySQL/MariaDB in two round trips, not three: the marker's INSERT
/// and the guarded UPDATE as one message of two statements (values written into the text, see
/// `inline.rs`), then the read of the stored row by primary key (MySQL/MariaDB have no `UPDATE
/// … RETURNING`). `None` when a value cannot be written in: the caller sends the three
/// statements bound, one by one. With `lease`, its check-and-free goes first in the message
/// (three statements): the write stands only when both it and the UPDATE found their row.
///
/// A failure of any statement is reported as the UPDATE's (see [`send_marked`]); the
/// transaction is rolled back either way.
#[cfg(feature = "mysql")]
async fn marked_update_mysql<E, C>(
    txn: &C,
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
    reply: Duration,
    lease: &Option<[Value; 3]>,
) -> Option<Result<(Option<E::Model>, Option<Evidence>), (Step, DbErr)>>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
    C: ConnectionTrait,
{
    let failed = |e| (Step::Update, e);
    let update = match guarded_update::<E>(original, changes, expected) {
        Ok(update) => update.into_query(),
        Err(e) => return Some(Err(failed(e))),
    };
    let marker = Marker::new();
    let message = marked_message(&marker, &update, lease.as_ref())?;
    let sent = send_marked(txn, &message, "UPDATE", lease.is_some());
    let found = match within(reply, sent).await {
        Ok(found) => found,
        Err(e) => return Some(Err(failed(e))),
    };
    match (found, lease) {
        (true, _) => {}
        (false, None) => return Some(Ok((None, Some(Evidence::Marker(marker))))),
        (false, Some(_)) => {
            let e = DbErr::Custom("the lease or the row not found by the UPDATE's message".into());
            return Some(Err((Step::Lease, e)));
        }
    }
    let pk = original.get_primary_key_value();
    let stored = match within(reply, select_by_key::<E>(&pk).one(txn)).await {
        Ok(Some(stored)) => stored,
        Ok(None) => {
            let e = DbErr::RecordNotFound("the updated row, read back in its transaction".into());
            return Some(Err(failed(e)));
        }
        Err(e) => return Some(Err(failed(e))),
    };
    Some(Ok((Some(stored), Some(Evidence::Marker(marker)))))
}

/// `marker`'s INSERT and `statement` (the guarded UPDATE or DELETE of one row) as the text of
/// one MySQL/MariaDB message — after `lease`'s check-and-free when given (its values, see
/// [`Sending::lease`]) —, or `None` when a value cannot be written in (see `inline.rs`).
#[cfg(feature = "mysql")]
pub(super) fn marked_message(
    marker: &Marker,
    statement: &impl sea_orm::sea_query::QueryStatementWriter,
    lease: Option<&[Value; 3]>,
) -> Option<String> {
    let insert = crate::db::inline::mysql::statement(&marker.insert(DbBackend::MySql, true))?;
    let message = format!(
        "{insert}; {}",
        crate::db::inline::mysql::statement(statement)?
    );
    match lease {
        None => Some(message),
        Some(lease) => {
            let free = crate::lock::lease::lease_free_written(lease.clone())?;
            Some(format!("{free}; {message}"))
        }
    }
}

/// A held lease's check-and-free ([`crate::lock::lease::lease_free`], `lease` its values) as a
/// bound statement of its own on MySQL/MariaDB, in `db`'s transaction: whether it found the
/// lease held (and freed it, for this transaction's commit to end).
#[cfg(feature = "mysql")]
pub(super) async fn free_lease<C: ConnectionTrait>(
    db: &C,
    lease: [Value; 3],
) -> Result<bool, DbErr> {
    let free = crate::lock::lease::lease_free(DbBackend::MySql);
    let free = crate::lock::sql::statement(DbBackend::MySql, &free, lease.to_vec());
    Ok(db.execute_raw(free).await?.rows_affected() == 1)
}

/// Sends a [`marked_message`] on `db`; whether its `what` (UPDATE or DELETE) found the row —
/// with `leased` (the message begins with a lease's check-and-free), whether both found theirs.
/// The reply counts the rows of every statement: the marker's one, and the row each other
/// statement found (sqlx asks for found rows, not changed ones — as sea-orm's own check of an
/// UPDATE relies on). A statement that fails stops the message there.
#[cfg(feature = "mysql")]
pub(super) async fn send_marked<C: ConnectionTrait>(
    db: &C,
    message: &str,
    what: &str,
    leased: bool,
) -> Result<bool, DbErr> {
    let all = if leased { 3 } else { 2 };
    match db.execute_unprepared(message).await?.rows_affected() {
        rows if rows == all => Ok(true),
        rows if (1..all).contains(&rows) => Ok(false),
        rows => Err(DbErr::Custom(format!(
            "the commit marker and the {what} reported {rows} rows, not 1 to {all}"
        ))),
    }
}

/// What [`update_returning_stamped`] carries besides the row (see `commit/`).
pub(crate) enum Stamp<'a> {
    /// An INSERT, the write's commit marker, run by the same statement as a data-modifying
    /// CTE: `WITH freshlock_marker AS (INSERT …) UPDATE … RETURNING …`. The CTE runs whether
    /// or not the UPDATE matches a row; a refused write rolls back, marker and all.
    Marker(Box<InsertStatement>),
    /// The transaction's id returned beside the row (`RETURNING …, txid_current()`), and when
    /// the plan asks for it the server incarnation's token too (`(SELECT token FROM
    /// freshlock_incarnation …)`, a second table read by the statement): nothing more is
    /// written.
    Xid(&'a Stamped),
}

/// [`update_returning`] on PostgreSQL, with the write's evidence of commit taken by the same
/// statement (`stamp`): no round trip of its own. Returns the stored row, and the row as the
/// statement returned it (for [`Stamped::evidence`]).
pub(crate) async fn update_returning_stamped<E, C>(
    db: &C,
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
    stamp: Stamp<'_>,
) -> Result<Option<(E::Model, QueryResult)>, DbErr>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
    C: ConnectionTrait,
{
    let backend = db.get_database_backend();
    let row = match stamp {
        Stamp::Marker(marker) => {
            let query = returning::<E>(backend, original, changes, expected, [])?;
            db.query_one(&behind_marker(query, *marker)).await?
        }
        Stamp::Xid(stamped) => {
            let stamps = stamped.exprs().iter().map(|stamp| Expr::cust(*stamp));
            db.query_one(&returning::<E>(
                backend, original, changes, expected, stamps,
            )?)
            .await?
        }
    };
    let Some(row) = row else {
        return Ok(None);
    };
    let model = E::Model::from_query_result(&row, "")?;
    Ok(Some((model, row)))
}

/// The guarded UPDATE of `original`'s row returning each column as sea-orm's own `exec` returns
/// it (as it selects it), and `extra` expressions after them.
fn returning<E>(
    backend: DbBackend,
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
    extra: impl IntoIterator<Item = Expr>,
) -> Result<UpdateStatement, DbErr>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
{
    let mut query = guarded_update::<E>(original, changes, expected)?.into_query();
    let columns = E::Column::iter().map(|c| c.select_as(c.into_returning_expr(backend)));
    query.returning(Query::returning().exprs(columns.chain(extra)));
    Ok(query)
}

/// `query` behind `marker`'s INSERT as a data-modifying CTE (see [`Stamp::Marker`]).
fn behind_marker(query: UpdateStatement, marker: InsertStatement) -> WithQuery {
    let cte = CommonTableExpression::new()
        .table_name(Alias::new("freshlock_marker"))
        .query(marker)
        .to_owned();
    query.with(WithClause::new().cte(cte).to_owned())
}

/// The guarded UPDATE of a write in two flights on PostgreSQL (`write/flights.rs`), returning
/// the row as [`update_returning`] does, behind `marker`'s INSERT when the write's evidence is
/// a marker: its commit evidence was taken before it (the transaction's id, read by the reload),
/// or rides in it.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn returning_statement<E>(
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
    marker: Option<InsertStatement>,
) -> Result<sea_orm::Statement, DbErr>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
{
    let backend = DbBackend::Postgres;
    let query = returning::<E>(backend, original, changes, expected, [])?;
    Ok(match marker {
        None => backend.build(&query),
        Some(marker) => backend.build(&behind_marker(query, marker)),
    })
}

/// The guarded UPDATE of `original`'s row on `backend`, returning nothing: MySQL/MariaDB's, for a
/// write in two flights (`write/flights.rs`), which reads the row back in the same message.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn update_statement<E>(
    backend: DbBackend,
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
) -> Result<sea_orm::Statement, DbErr>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
{
    Ok(backend.build(&guarded_update::<E>(original, changes, expected)?.into_query()))
}

/// The guarded UPDATE of `original`'s row, as sea-orm builds it.
fn guarded_update<E>(
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
) -> Result<sea_orm::ValidatedUpdateOne<E::ActiveModel>, DbErr>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
{
    let mut update = original.clone().into_active_model();
    for (column, value) in changes {
        update.set(*column, value.clone());
    }
    let mut update = E::update(update).validate()?;
    for (column, value) in expected {
        update = update.filter(holds::<E>(*column, value));
    }
    Ok(update)
}
