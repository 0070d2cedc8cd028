//! What a draft's primary key says: the row it names, whether it was built from a snapshot,
//! and a key set for an insert.

use sea_orm::{
    ActiveModelTrait, ActiveValue, EntityTrait, IdenStatic, Iterable, ModelTrait,
    PrimaryKeyToColumn, sea_query::ValueTuple,
};

use crate::{error::Error, write::row::Row};

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
