//! An order that reserved units of a [`stock`](super::stock) row.

use sea_orm::entity::prelude::*;

/// One order.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "purchase_order")]
pub struct Model {
    /// Primary key (given by the caller: a request id).
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: i64,
    /// The item reserved.
    pub stock_id: i32,
    /// Units reserved.
    pub quantity: i32,
}

/// Orders relate to nothing here.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
