//! The Django report's `HamLock`: one row per Ham, locked instead of the Ham row.

use sea_orm::entity::prelude::*;

/// One lock row, keyed by its Ham.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "ham_lock")]
pub struct Model {
    /// The Ham this row locks (also the primary key: one lock row per Ham).
    #[sea_orm(primary_key, auto_increment = false)]
    pub ham_id: i32,
    /// Last time the lock row was taken, in milliseconds since the Unix epoch.
    pub updated_at: i64,
}

/// Relations of a lock row.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {
    /// The Ham it locks.
    #[sea_orm(
        belongs_to = "super::ham::Entity",
        from = "Column::HamId",
        to = "super::ham::Column::Id",
        on_delete = "Cascade"
    )]
    Ham,
}

impl Related<super::ham::Entity> for Entity {
    fn to() -> RelationDef {
        Relation::Ham.def()
    }
}

impl ActiveModelBehavior for ActiveModel {}
