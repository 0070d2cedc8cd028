//! Stock of an item: a reservation decrements it and inserts a
//! [`purchase_order`](super::purchase_order) in the same locked transaction.

use sea_orm::entity::prelude::*;

/// The stock of one item.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "stock")]
pub struct Model {
    /// Primary key: the item.
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: i32,
    /// Units left, never below zero.
    pub quantity: i32,
}

/// Stock relates to nothing here.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
