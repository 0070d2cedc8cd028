//! The statements of one save and one insert, on any connection (a pool, a transaction of
//! the repository's own, a section's): written once for `Repository` and `TxRepository`.

use crate::write::entity::Writable;
use sea_orm::{ActiveModelTrait, ActiveValue, ConnectionTrait, ModelTrait};

use crate::{
    commit,
    error::{Result, database},
    write::row::{Row, select_by_key},
    write::row_sql::{self as write, Inserted, reject_set_primary_key},
};

/// What a save found.
pub(crate) enum Saved<M> {
    /// Written; the row as stored, and what `after_save` made of it.
    Stored {
        stored: M,
        reported: M,
    },
    /// Nothing to write, and the row still holds what was set.
    Holds(M),
    Conflict,
    NotFound,
}

/// The statements of one save, on `db` (a transaction on MySQL/MariaDB, or a section's).
/// `autocommit`: the UPDATE is its own commit, so a lost connection leaves it in doubt.
pub(crate) async fn save_on<E, C>(
    db: &C,
    row: &Row,
    snapshot: &E::Model,
    model: E::ActiveModel,
    version: Option<E::Column>,
    autocommit: bool,
) -> Result<Saved<E::Model>>
where
    E: Writable,
    C: ConnectionTrait,
{
    let fail = |operation| move |e| database(operation, row, e);
    let version_read = version.map(|column| match model.get(column) {
        ActiveValue::Unchanged(value) => value,
        _ => snapshot.get(column),
    });
    // Nothing the caller set differs from the snapshot: no hook runs (a `before_save` that
    // stamps `updated_at` would make a change that is not one), and nothing is written — the
    // row is only checked to still hold the snapshot (`Unchanged`), as `locked_update` does.
    let caller_changed = write::set_columns::<E>(&model)
        .iter()
        .any(|(column, value)| *value != snapshot.get(*column));
    let model = if caller_changed {
        write::before_save::<E, _>(model, db, false)
            .await
            .map_err(fail("running before_save for"))?
    } else {
        model
    };
    reject_set_primary_key::<E>(&model)?;
    let set = write::set_columns::<E>(&model);
    let mut changes: Vec<_> = set
        .iter()
        .filter(|(column, value)| *value != snapshot.get(*column))
        .cloned()
        .collect();
    let read = version.zip(version_read);
    let unversioned = |_: &[write::ColumnValue<E>]| {
        (set.iter())
            .map(|(column, _)| (*column, snapshot.get(*column)))
            .collect()
    };
    let expected = write::guard::<E>(read, &mut changes, unversioned)?;
    let stored = if changes.is_empty() {
        write::select_holding::<E, _>(db, row.pk(), &expected)
            .await
            .map_err(fail("checking"))?
    } else {
        write::update_returning::<E, _>(db, snapshot, &changes, &expected)
            .await
            // In autocommit the UPDATE is its own commit: a lost connection leaves it in doubt.
            .map_err(|e| {
                if autocommit {
                    commit::write_error("saving", row.name.as_str(), e)
                } else {
                    database("saving", row, e)
                }
            })?
    };
    match stored {
        Some(stored) if changes.is_empty() => Ok(Saved::Holds(stored)),
        Some(stored) => {
            let reported = write::after_save::<E, _>(stored.clone(), db, false)
                .await
                .map_err(fail("running after_save for"))?;
            Ok(Saved::Stored { stored, reported })
        }
        // Refused: tell a changed row from a missing one (only on this path).
        None => match select_by_key::<E>(row.pk())
            .one(db)
            .await
            .map_err(fail("checking"))?
        {
            Some(_) => Ok(Saved::Conflict),
            None => Ok(Saved::NotFound),
        },
    }
}

/// `before_save`, `INSERT … RETURNING`, `after_save` on `db`: the row, as stored, and what
/// `after_save` made of it.
pub(crate) async fn insert_on<E, C>(
    db: &C,
    model: E::ActiveModel,
) -> Result<(Row, E::Model, E::Model)>
where
    E: Writable,
    C: ConnectionTrait,
{
    let table = E::default().table_name();
    // One message for every step (a unique-key violation included: no concurrent creator is
    // expected here; `get_or_insert` is the call for that).
    let (stored, reported) = match write::insert_row::<E, _>(db, model).await {
        Ok(Inserted::Stored { stored, reported }) => (stored, reported),
        Ok(Inserted::Taken(e)) | Err(write::Failed { error: e, .. }) => {
            return Err(database("inserting into", &table, e));
        }
    };
    let row = Row::new::<E>(stored.get_primary_key_value())?;
    Ok((row, stored, reported))
}
