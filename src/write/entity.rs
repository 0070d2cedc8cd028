//! What freshlock needs of an entity to write it — every plain sea-orm entity has it — said once
//! for the write path's functions (the public front ends spell the same bounds out, so that a
//! user's compiler error names sea-orm's traits, not ours).

use sea_orm::{EntityTrait, IntoActiveModel};

/// An entity whose rows freshlock can reload, change and write: its model converts back to an
/// active model and may be shared, its active model may cross an `await`.
pub(crate) trait Writable:
    EntityTrait<Model: IntoActiveModel<Self::ActiveModel> + Sync, ActiveModel: Send>
{
}

impl<E> Writable for E
where
    E: EntityTrait,
    E::Model: IntoActiveModel<E::ActiveModel> + Sync,
    E::ActiveModel: Send,
{
}
