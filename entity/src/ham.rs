//! The parent row of the Django report: work is serialized per Ham, but the Ham itself must stay
//! readable and writable while its Spams are processed.

use sea_orm::entity::prelude::*;

/// One ham row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "ham")]
pub struct Model {
    /// Primary key.
    #[sea_orm(primary_key)]
    pub id: i32,
    /// A name, for display.
    pub name: String,
    /// Last change, in milliseconds since the Unix epoch.
    pub updated_at: i64,
}

/// Relations of a ham.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {
    /// The children.
    #[sea_orm(has_many = "super::spam::Entity")]
    Spam,
    /// The 1:1 lock row.
    #[sea_orm(has_one = "super::ham_lock::Entity")]
    HamLock,
}

impl Related<super::spam::Entity> for Entity {
    fn to() -> RelationDef {
        Relation::Spam.def()
    }
}

impl Related<super::ham_lock::Entity> for Entity {
    fn to() -> RelationDef {
        Relation::HamLock.def()
    }
}

impl ActiveModelBehavior for ActiveModel {}
