//! The columns of a row write: which changed, which are set, what the write checks (its
//! guard), and the version column's next value.

use sea_orm::{
    ActiveModelTrait, ActiveValue, EntityTrait, IdenStatic, Iterable, ModelTrait, Value,
};

use crate::error::Error;

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
