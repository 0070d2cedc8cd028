//! Inserts and deletes through sea-orm's `ActiveModel` (so its hooks run), and the hooks
//! themselves for the writes freshlock builds by hand.

use crate::write::entity::Writable;
use sea_orm::{ActiveModelBehavior, ConnectionTrait, DbErr, EntityTrait};

/// A statement of a row write that failed, and what it was doing (`"inserting"`, `"running
/// before_save for"`, …: the words of [`crate::error::database`]'s message).
pub(crate) struct Failed {
    pub(crate) operation: &'static str,
    pub(crate) error: DbErr,
}

/// The `map_err` of one step of a row write.
pub(super) fn step(operation: &'static str) -> impl FnOnce(DbErr) -> Failed {
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
    E: Writable,
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
