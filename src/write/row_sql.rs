//! The write primitives every write path shares: which columns changed, what the UPDATE checks,
//! the guarded UPDATE that returns the row as the database stores it, and sea-orm's hooks.
//!
//! This module sits below the repository, the locked driver and sections: it knows entities,
//! SQL and the commit's evidence (`commit.rs`), nothing of sessions, caches or locks.

use std::time::Duration;

use sea_orm::{
    ActiveModelBehavior, ActiveModelTrait, ActiveValue, ColumnTrait, ColumnType, ConnectionTrait,
    DatabaseTransaction, DbBackend, DbErr, EntityTrait, FromQueryResult, IdenStatic,
    IntoActiveModel, Iterable, ModelTrait, PrimaryKeyToColumn, QueryFilter, QueryResult,
    QueryTrait, Value,
    sea_query::{
        Alias, CommonTableExpression, Expr, InsertStatement, Query, ValueTuple, WithClause,
    },
};

use crate::{
    commit::{Evidence, Marker, Plan, Stamped},
    db::deadline::within,
    db::pool::Pool,
    error::Error,
    write::row::{Row, select_by_key},
};

/// A column and a value: set by a write, or expected by its guard.
pub(crate) type ColumnValue<E> = (<E as EntityTrait>::Column, Value);

/// The columns `Set` in `draft` to a value other than `original`'s, taken out of `draft`.
pub(crate) fn changed_columns<E: EntityTrait>(
    original: &E::Model,
    draft: &mut E::ActiveModel,
) -> Vec<ColumnValue<E>>
where
    E::ActiveModel: ActiveModelTrait<Entity = E>,
{
    E::Column::iter()
        .filter_map(|column| match draft.take(column) {
            ActiveValue::Set(value) if value != original.get(column) => Some((column, value)),
            _ => None,
        })
        .collect()
}

/// Whether `draft` sets any column to a value other than `original`'s (nothing is taken out).
pub(crate) fn has_changes<E: EntityTrait>(original: &E::Model, draft: &E::ActiveModel) -> bool
where
    E::ActiveModel: ActiveModelTrait<Entity = E>,
{
    E::Column::iter().any(|column| match draft.get(column) {
        ActiveValue::Set(value) => value != original.get(column),
        _ => false,
    })
}

/// The columns `Set` in `draft`, with their values (the draft is left as it is).
pub(crate) fn set_columns<E: EntityTrait>(draft: &E::ActiveModel) -> Vec<ColumnValue<E>>
where
    E::ActiveModel: ActiveModelTrait<Entity = E>,
{
    E::Column::iter()
        .filter_map(|column| match draft.get(column) {
            ActiveValue::Set(value) => Some((column, value)),
            _ => None,
        })
        .collect()
}

/// `E`'s column called `name`.
pub(crate) fn column_named<E: EntityTrait>(name: &str) -> Option<E::Column> {
    E::Column::iter().find(|column| column.as_str() == name)
}

/// Whether `column` of `E` is declared as an integer column (what a version column must be).
pub(crate) fn is_integer_column<E: EntityTrait>(column: &E::Column) -> bool {
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

/// The value after `value` of an integer version column; `None` for NULL or a non-integer.
pub(crate) fn next_version(value: &Value) -> Option<Value> {
    Some(match value {
        Value::TinyInt(Some(v)) => Value::TinyInt(Some(v.wrapping_add(1))),
        Value::SmallInt(Some(v)) => Value::SmallInt(Some(v.wrapping_add(1))),
        Value::Int(Some(v)) => Value::Int(Some(v.wrapping_add(1))),
        Value::BigInt(Some(v)) => Value::BigInt(Some(v.wrapping_add(1))),
        Value::TinyUnsigned(Some(v)) => Value::TinyUnsigned(Some(v.wrapping_add(1))),
        Value::SmallUnsigned(Some(v)) => Value::SmallUnsigned(Some(v.wrapping_add(1))),
        Value::Unsigned(Some(v)) => Value::Unsigned(Some(v.wrapping_add(1))),
        Value::BigUnsigned(Some(v)) => Value::BigUnsigned(Some(v.wrapping_add(1))),
        _ => return None,
    })
}

/// `column = value`, or `column IS NULL` for a NULL value.
fn holds<E: EntityTrait>(column: E::Column, value: &Value) -> sea_orm::Condition {
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
    /// ([`crate::lock::sql::lease_free`]: name, owner token, fence), sent first in the marker's
    /// and the UPDATE's message — or, where that message cannot be written, as a statement of
    /// its own before them. The caller has not checked the lease; a write returned then found
    /// it held, and its transaction frees it.
    pub(crate) lease: Option<[Value; 3]>,
}

/// The guarded UPDATE of a locked write (as [`update_returning`]), with the evidence of its
/// commit when `sending.markers` asks for it, taken in the fewest round trips the database
/// allows (see `commit.rs`): on PostgreSQL the UPDATE returns its transaction id (and the server
/// incarnation's token when the pool has not seen it lately), or writes a marker in its own
/// statement without `freshlock_incarnation`; on MySQL/MariaDB a marker's INSERT goes with the
/// UPDATE as one message where their values can be written into its text
/// ([`marked_update_mysql`]), with a lease's check-and-free first when there is one; elsewhere
/// a marker's INSERT goes first. Each round trip waits at most `sending.reply`.
///
/// # Errors
/// The failed step and its error; the transaction is to be rolled back.
pub(crate) async fn update_with_evidence<E>(
    txn: &DatabaseTransaction,
    sending: Sending<'_>,
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
) -> Result<(Option<E::Model>, Option<Evidence>), (Step, DbErr)>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
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
        let marked = marked_update_mysql::<E>(txn, original, changes, expected, reply, &lease);
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
async fn marked_update_mysql<E>(
    txn: &DatabaseTransaction,
    original: &E::Model,
    changes: &[ColumnValue<E>],
    expected: &[ColumnValue<E>],
    reply: Duration,
    lease: &Option<[Value; 3]>,
) -> Option<Result<(Option<E::Model>, Option<Evidence>), (Step, DbErr)>>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
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
fn marked_message(
    marker: &Marker,
    statement: &impl sea_orm::sea_query::QueryStatementWriter,
    lease: Option<&[Value; 3]>,
) -> Option<String> {
    let insert = crate::db::inline::mysql(&marker.insert(DbBackend::MySql, true))?;
    let message = format!("{insert}; {}", crate::db::inline::mysql(statement)?);
    match lease {
        None => Some(message),
        Some(lease) => {
            let free = crate::lock::sql::lease_free_written(lease.clone())?;
            Some(format!("{free}; {message}"))
        }
    }
}

/// A held lease's check-and-free ([`crate::lock::sql::lease_free`], `lease` its values) as a
/// bound statement of its own on MySQL/MariaDB, in `db`'s transaction: whether it found the
/// lease held (and freed it, for this transaction's commit to end).
#[cfg(feature = "mysql")]
async fn free_lease<C: ConnectionTrait>(db: &C, lease: [Value; 3]) -> Result<bool, DbErr> {
    let free = crate::lock::sql::lease_free(DbBackend::MySql);
    let free = crate::lock::sql::statement(DbBackend::MySql, &free, lease.to_vec());
    Ok(db.execute_raw(free).await?.rows_affected() == 1)
}

/// Sends a [`marked_message`] on `db`; whether its `what` (UPDATE or DELETE) found the row —
/// with `leased` (the message begins with a lease's check-and-free), whether both found theirs.
/// The reply counts the rows of every statement: the marker's one, and the row each other
/// statement found (sqlx asks for found rows, not changed ones — as sea-orm's own check of an
/// UPDATE relies on). A statement that fails stops the message there.
#[cfg(feature = "mysql")]
async fn send_marked<C: ConnectionTrait>(
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

/// What [`update_returning_stamped`] carries besides the row (see `commit.rs`).
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
    let mut query = guarded_update::<E>(original, changes, expected)?.into_query();
    // As sea-orm's own `exec` returns the row: each column as it selects it.
    let columns = E::Column::iter().map(|c| c.select_as(c.into_returning_expr(backend)));
    let row = match stamp {
        Stamp::Marker(marker) => {
            query.returning(Query::returning().exprs(columns));
            let cte = CommonTableExpression::new()
                .table_name(Alias::new("freshlock_marker"))
                .query(*marker)
                .to_owned();
            let query = query.with(WithClause::new().cte(cte).to_owned());
            db.query_one(&query).await?
        }
        Stamp::Xid(stamped) => {
            let stamps = stamped.exprs().iter().map(|stamp| Expr::cust(*stamp));
            query.returning(Query::returning().exprs(columns.chain(stamps)));
            db.query_one(&query).await?
        }
    };
    let Some(row) = row else {
        return Ok(None);
    };
    let model = E::Model::from_query_result(&row, "")?;
    Ok(Some((model, row)))
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

/// The row with primary key `pk`, if it still holds every expected value: the check of a write
/// that has nothing to change.
pub(crate) async fn select_holding<E, C>(
    db: &C,
    pk: &ValueTuple,
    expected: &[ColumnValue<E>],
) -> Result<Option<E::Model>, DbErr>
where
    E: EntityTrait,
    C: ConnectionTrait,
{
    let mut select = select_by_key::<E>(pk);
    for (column, value) in expected {
        select = select.filter(holds::<E>(*column, value));
    }
    select.one(db).await
}

/// How a guarded delete ([`delete_row`]) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Removed {
    /// The row was deleted.
    Deleted,
    /// The guard refused: nothing deleted.
    Refused,
    /// The check-and-free of the lease sent with the DELETE (`lease`) did not confirm it (lost,
    /// or the DELETE found no row: the count of rows cannot tell which), as
    /// [`Step::Lease`]: nothing is to be kept, the attempt runs again with the lease checked by
    /// a statement of its own.
    LeaseNotConfirmed,
}

/// `DELETE … WHERE pk = <pk> AND <expected>`; how it ended ([`Removed`]).
///
/// With `marker`, the write's commit marker is inserted in the same transaction first: on
/// MySQL/MariaDB in the same message as the DELETE where their values can be written into its
/// text (see `inline.rs`; the reply then counts the marker's row too), else by a statement of
/// its own. `lease` (MySQL/MariaDB with `marker` only): a held lease's check-and-free, first in
/// that message or bound before it, as [`Sending::lease`] says for an UPDATE.
pub(crate) async fn delete_holding<E, C>(
    db: &C,
    pk: &ValueTuple,
    expected: &[ColumnValue<E>],
    marker: Option<&Marker>,
    lease: Option<[Value; 3]>,
) -> Result<Removed, DbErr>
where
    E: EntityTrait,
    C: ConnectionTrait,
{
    let mut delete = E::delete_many();
    for (column, value) in E::PrimaryKey::iter().zip(pk.iter()) {
        delete = delete.filter(holds::<E>(column.into_column(), value));
    }
    for (column, value) in expected {
        delete = delete.filter(holds::<E>(*column, value));
    }
    let removed = |deleted: bool| {
        if deleted {
            Removed::Deleted
        } else {
            Removed::Refused
        }
    };
    let backend = db.get_database_backend();
    let marker = match marker {
        // Not asked for by the row step (see `Locking::riding_write`): checked on its own then.
        _ if lease.is_some() && (marker.is_none() || backend != DbBackend::MySql) => {
            return Ok(Removed::LeaseNotConfirmed);
        }
        Some(marker) => marker,
        None => return Ok(removed(delete.exec(db).await?.rows_affected > 0)),
    };
    #[cfg(feature = "mysql")]
    if backend == DbBackend::MySql {
        let leased = lease.is_some();
        if let Some(message) = marked_message(marker, delete.as_query(), lease.as_ref()) {
            return Ok(match send_marked(db, &message, "DELETE", leased).await? {
                true => Removed::Deleted,
                false if leased => Removed::LeaseNotConfirmed,
                false => Removed::Refused,
            });
        }
        if let Some(lease) = lease
            && !free_lease(db, lease).await?
        {
            return Ok(Removed::LeaseNotConfirmed);
        }
    }
    db.execute(&marker.insert(backend, true)).await?;
    Ok(removed(delete.exec(db).await?.rows_affected > 0))
}

/// The optimistic guard of a write, written once for every write path: what its `WHERE` checks,
/// with `changes` completed by the version's increment.
///
/// With a declared version column (`version`: the column and the value the write read), the
/// write checks that the version still holds that value and, when it changes anything, sets it
/// to the next one. Without one, it checks what `unversioned` makes of the changes: that the
/// columns still hold what was read (the changed columns for a locked write, every column a save
/// sets for a save).
///
/// # Errors
/// [`Error::VersionColumn`] when the version read is NULL or not an integer.
pub(crate) fn guard<E: EntityTrait>(
    version: Option<(E::Column, Value)>,
    changes: &mut Vec<ColumnValue<E>>,
    unversioned: impl FnOnce(&[ColumnValue<E>]) -> Vec<ColumnValue<E>>,
) -> Result<Vec<ColumnValue<E>>, Error> {
    let Some((column, read)) = version else {
        return Ok(unversioned(changes));
    };
    let next = next_version(&read).ok_or_else(|| Error::VersionColumn {
        entity: E::default().table_name(),
        column: column.as_str(),
    })?;
    if !changes.is_empty() {
        changes.retain(|(changed, _)| changed.as_str() != column.as_str());
        changes.push((column, next));
    }
    Ok(vec![(column, read)])
}

/// What a guarded delete of `original` checks: its version column (`version`, the session's for
/// `E`), if one is declared. A delete changes no column, so nothing is incremented, and a NULL
/// version is checked as `IS NULL`.
pub(crate) fn version_guard<E: EntityTrait>(
    version: Option<E::Column>,
    original: &E::Model,
) -> Vec<ColumnValue<E>> {
    use sea_orm::ModelTrait;
    version
        .map(|column| (column, original.get(column)))
        .into_iter()
        .collect()
}

/// A statement of a row write that failed, and what it was doing (`"inserting"`, `"running
/// before_save for"`, …: the words of [`crate::error::database`]'s message).
pub(crate) struct Failed {
    pub(crate) operation: &'static str,
    pub(crate) error: DbErr,
}

/// The `map_err` of one step of a row write.
fn step(operation: &'static str) -> impl FnOnce(DbErr) -> Failed {
    move |error| Failed { operation, error }
}

/// How an insert ended.
pub(crate) enum Inserted<M> {
    /// The row as stored, and what `after_save` made of it.
    Stored { stored: M, reported: M },
    /// A unique-key violation: a concurrent creator won (the error, for callers for which that
    /// is one).
    Taken(DbErr),
}

/// The insert of one row, written once for every write path: `before_save` (`insert = true`),
/// `INSERT … RETURNING`, `after_save`, on `db`.
pub(crate) async fn insert_row<E, C>(
    db: &C,
    draft: E::ActiveModel,
) -> Result<Inserted<E::Model>, Failed>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
    C: ConnectionTrait,
{
    let draft = before_save::<E, _>(draft, db, true)
        .await
        .map_err(step("running before_save for"))?;
    let stored = match E::insert(draft).exec_with_returning(db).await {
        Ok(stored) => stored,
        Err(e) if crate::db::failure::is_unique_violation(&e) => return Ok(Inserted::Taken(e)),
        Err(e) => return Err(step("inserting")(e)),
    };
    let reported = after_save::<E, _>(stored.clone(), db, true)
        .await
        .map_err(step("running after_save for"))?;
    Ok(Inserted::Stored { stored, reported })
}

/// The guarded delete of one row, written once for every write path: `before_delete`,
/// `DELETE … WHERE pk AND <expected>` (with `marker`'s INSERT and `lease`'s check, see
/// [`delete_holding`]), `after_delete`, on `db`. Anything but [`Removed::Deleted`]: nothing
/// deleted, no `after_delete`.
pub(crate) async fn delete_row<E, C>(
    db: &C,
    original: &E::Model,
    pk: &ValueTuple,
    expected: &[ColumnValue<E>],
    marker: Option<&Marker>,
    lease: Option<[Value; 3]>,
) -> Result<Removed, Failed>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
    E::ActiveModel: Send,
    C: ConnectionTrait,
{
    let draft = original.clone().into_active_model();
    let draft = before_delete::<E, _>(draft, db)
        .await
        .map_err(step("running before_delete for"))?;
    let removed = delete_holding::<E, _>(db, pk, expected, marker, lease)
        .await
        .map_err(step("deleting"))?;
    if removed != Removed::Deleted {
        return Ok(removed);
    }
    after_delete::<E, _>(draft, db)
        .await
        .map_err(step("running after_delete for"))?;
    Ok(Removed::Deleted)
}

/// The row a save of `model` writes: its key must be set, and not `Set`.
pub(crate) fn saved_row<E: EntityTrait>(model: &E::ActiveModel) -> crate::error::Result<Row> {
    let Some(pk) = model.get_primary_key_value() else {
        return Err(Error::InvalidKey {
            entity: E::default().table_name(),
            reason: "the primary key of the active model is not set".into(),
        });
    };
    reject_set_primary_key::<E>(model)?;
    Row::new::<E>(pk)
}

/// Whether `model`'s `Unchanged` columns agree with `snapshot` (it was built from that copy).
pub(crate) fn built_from<E: EntityTrait>(model: &E::ActiveModel, snapshot: &E::Model) -> bool {
    E::Column::iter().all(|column| match model.get(column) {
        ActiveValue::Unchanged(value) => value == snapshot.get(column),
        _ => true,
    })
}

/// [`InvalidKey`](Error::InvalidKey) when `model` has a primary-key column `Set`.
pub(crate) fn reject_set_primary_key<E>(model: &E::ActiveModel) -> crate::error::Result<()>
where
    E: EntityTrait,
{
    match E::PrimaryKey::iter()
        .map(PrimaryKeyToColumn::into_column)
        .find(|column| matches!(model.get(*column), ActiveValue::Set(_)))
    {
        Some(column) => Err(Error::InvalidKey {
            entity: E::default().table_name(),
            reason: format!(
                "primary-key column {} is Set: a save identifies its row by the key and cannot \
                 change it (keep it Unchanged, as into_active_model does)",
                column.as_str()
            ),
        }),
        None => Ok(()),
    }
}

/// `draft` with its primary key set to `pk` where it was left `NotSet`;
/// [`InvalidKey`](Error::InvalidKey) when it holds another key.
pub(crate) fn keyed<E: EntityTrait>(
    mut draft: E::ActiveModel,
    pk: &ValueTuple,
) -> crate::error::Result<E::ActiveModel> {
    for (key, value) in E::PrimaryKey::iter().zip(pk.iter()) {
        let column = key.into_column();
        match draft.get(column).into_value() {
            None => draft.set(column, value.clone()),
            Some(given) if given == *value => {}
            Some(given) => {
                return Err(Error::InvalidKey {
                    entity: E::default().table_name(),
                    reason: format!(
                        "the initial row's {} is {given}, but the row asked for is {value}",
                        column.as_str()
                    ),
                });
            }
        }
    }
    Ok(draft)
}

/// sea-orm's `before_save` hook, as `ActiveModel::insert` / `update` run it.
pub(crate) async fn before_save<E, C>(
    draft: E::ActiveModel,
    db: &C,
    insert: bool,
) -> Result<E::ActiveModel, DbErr>
where
    E: EntityTrait,
    E::ActiveModel: Send,
    C: ConnectionTrait,
{
    ActiveModelBehavior::before_save(draft, db, insert).await
}

/// sea-orm's `after_save` hook.
pub(crate) async fn after_save<E, C>(
    model: E::Model,
    db: &C,
    insert: bool,
) -> Result<E::Model, DbErr>
where
    E: EntityTrait,
    E::ActiveModel: Send,
    C: ConnectionTrait,
{
    <E::ActiveModel as ActiveModelBehavior>::after_save(model, db, insert).await
}

/// sea-orm's `before_delete` hook.
pub(crate) async fn before_delete<E, C>(
    draft: E::ActiveModel,
    db: &C,
) -> Result<E::ActiveModel, DbErr>
where
    E: EntityTrait,
    E::ActiveModel: Send,
    C: ConnectionTrait,
{
    ActiveModelBehavior::before_delete(draft, db).await
}

/// sea-orm's `after_delete` hook.
pub(crate) async fn after_delete<E, C>(
    draft: E::ActiveModel,
    db: &C,
) -> Result<E::ActiveModel, DbErr>
where
    E: EntityTrait,
    E::ActiveModel: Send,
    C: ConnectionTrait,
{
    ActiveModelBehavior::after_delete(draft, db).await
}
