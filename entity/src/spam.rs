//! A child row of a Ham; its `state` moves new → processing → done.

use sea_orm::entity::prelude::*;

/// One spam row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "spam")]
pub struct Model {
    /// Primary key.
    #[sea_orm(primary_key)]
    pub id: i32,
    /// The parent.
    pub ham_id: i32,
    /// `new`, `processing` or `done`.
    pub state: String,
    /// Last change, in milliseconds since the Unix epoch.
    pub updated_at: i64,
}

/// Relations of a spam.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {
    /// The parent.
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
