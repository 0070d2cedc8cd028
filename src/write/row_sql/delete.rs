//! The guarded DELETE and the locked read that checks a row still holds what was expected.

use sea_orm::{
    ActiveModelBehavior, ConnectionTrait, DbBackend, DbErr, DeleteMany, EntityTrait,
    IntoActiveModel, Iterable, PrimaryKeyToColumn, QueryFilter, Value, sea_query::ValueTuple,
};

#[cfg(feature = "mysql")]
use super::update::{free_lease, marked_message, send_marked};
use super::{
    columns::ColumnValue,
    hooks::{Failed, step},
    update::holds,
};
use crate::{commit::Marker, write::row::select_by_key};
#[cfg(feature = "mysql")]
use sea_orm::QueryTrait;

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

/// Sends `delete` (`DELETE … WHERE pk = <pk> AND <expected>`); how it ended ([`Removed`]).
///
/// With `marker`, the write's commit marker is inserted in the same transaction first: on
/// MySQL/MariaDB in the same message as the DELETE where their values can be written into its
/// text (see `inline.rs`; the reply then counts the marker's row too), else by a statement of
/// its own. `lease` (MySQL/MariaDB with `marker` only): a held lease's check-and-free, first in
/// that message or bound before it, as [`Sending::lease`] says for an UPDATE.
async fn delete_holding<E, C>(
    db: &C,
    delete: DeleteMany<E>,
    marker: Option<&Marker>,
    lease: Option<[Value; 3]>,
) -> Result<Removed, DbErr>
where
    E: EntityTrait,
    C: ConnectionTrait,
{
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
    let draft = ActiveModelBehavior::before_delete(draft, db)
        .await
        .map_err(step("running before_delete for"))?;
    let mut delete = E::delete_many();
    for (column, value) in E::PrimaryKey::iter().zip(pk.iter()) {
        delete = delete.filter(holds::<E>(column.into_column(), value));
    }
    for (column, value) in expected {
        delete = delete.filter(holds::<E>(*column, value));
    }
    let removed = delete_holding(db, delete, marker, lease)
        .await
        .map_err(step("deleting"))?;
    if removed != Removed::Deleted {
        return Ok(removed);
    }
    ActiveModelBehavior::after_delete(draft, db)
        .await
        .map_err(step("running after_delete for"))?;
    Ok(Removed::Deleted)
}
