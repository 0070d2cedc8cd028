//! One locked row's UPDATE, written once for the one-row step (`row_step.rs`: `locked_update`)
//! and the many-row step (`rows_step.rs`: `locked_update_many`, `_pair`): `before_save`, the
//! primary-key check and the changed columns ([`changes`]); then the optimistic guard and the
//! guarded UPDATE, taking the commit's evidence in its own statement when asked to
//! ([`update`]). What only one of the steps does around it — commit combining, a lease's check
//! riding in the UPDATE's message, a lock folded into the reload — stays in that step.

use crate::write::entity::Writable;
use sea_orm::{ConnectionTrait, DatabaseTransaction, EntityTrait, IntoActiveModel, ModelTrait};
use tracing::debug;

use crate::{
    commit::Evidence,
    db::deadline::Bounded,
    error::{Error, database},
    write::row::Row,
    write::row_sql::{self as write, ColumnValue, Sending},
};

/// `before_save` on `draft`, the key it must not move, and the columns it changed from
/// `original` (the row as reloaded under the lock), on the write's transaction.
///
/// # Errors
/// [`Error::Database`] when `before_save` fails; [`Error::PrimaryKeyChanged`] when the draft
/// moved the row's key.
pub(crate) async fn changes<E, C>(
    txn: &Bounded<'_, C>,
    row: &Row,
    original: &E::Model,
    draft: E::ActiveModel,
) -> Result<Vec<ColumnValue<E>>, Error>
where
    E: Writable,
    C: ConnectionTrait,
{
    let mut draft = write::before_save::<E, _>(draft, txn, false)
        .await
        .map_err(|e| database("running before_save for", row, e))?;
    row.check_key::<E>(&draft)?;
    Ok(write::changed_columns::<E>(original, &mut draft))
}

/// What a locked write's UPDATE checks (see [`update`]), with `changes` completed by the version's
/// increment.
///
/// # Errors
/// The guard's error when the version column cannot be advanced.
pub(crate) fn expected<E: EntityTrait>(
    version: Option<E::Column>,
    original: &E::Model,
    changes: &mut Vec<ColumnValue<E>>,
) -> Result<Vec<ColumnValue<E>>, Error> {
    let read = version.map(|column| (column, original.get(column)));
    let unversioned = |changes: &[ColumnValue<E>]| {
        (changes.iter())
            .map(|(column, _)| (*column, original.get(*column)))
            .collect()
    };
    write::guard::<E>(read, changes, unversioned)
}

/// What a row's guarded UPDATE did.
pub(crate) enum Updated<M> {
    /// Written: the row as the database stored it, and the commit's evidence when the
    /// statement took it.
    Stored(M, Option<Evidence>),
    /// Refused by the guard: the row no longer holds what was read (a conflict).
    Refused,
    /// The check of a lease riding in the UPDATE's message did not confirm it (see
    /// [`Sending::lease`]): nothing is to be kept, and the attempt runs again with the lease
    /// checked by a statement of its own.
    LeaseNotConfirmed,
}

/// The optimistic guard over `changes` — the version column, when `version` names one, else
/// every changed column must still hold what `original` read, so that a write made without the
/// lock is never overwritten unseen — then the UPDATE, with the commit's evidence in its own
/// statement where `sending` asks for it and the database allows.
///
/// # Errors
/// [`Error::Database`] when a statement fails; the guard's error when the version column
/// cannot be advanced.
pub(crate) async fn update<E>(
    txn: &DatabaseTransaction,
    row: &Row,
    version: Option<E::Column>,
    original: &E::Model,
    mut changes: Vec<ColumnValue<E>>,
    sending: Sending<'_>,
) -> Result<Updated<E::Model>, Error>
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel>,
{
    let expected = expected::<E>(version, original, &mut changes)?;
    match write::update_with_evidence::<E, _>(txn, sending, original, &changes, &expected).await {
        Ok((Some(stored), evidence)) => Ok(Updated::Stored(stored, evidence)),
        Ok((None, _)) => Ok(Updated::Refused),
        Err((write::Step::Lease, e)) => {
            debug!(row = %row.name, error = %e, "the lease's check in the UPDATE's message did not confirm it; again, checked on its own");
            Ok(Updated::LeaseNotConfirmed)
        }
        Err((write::Step::Evidence, e)) => Err(database("marking the commit of", row, e)),
        Err((write::Step::Update, e)) => Err(database("writing", row, e)),
    }
}
