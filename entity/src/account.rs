//! Accounts with a balance: money moves between two of them in one locked transaction
//! (`locked_update_pair`), and the sum never changes.

use sea_orm::entity::prelude::*;

/// One account.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "bank_account")]
pub struct Model {
    /// Primary key.
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: i32,
    /// The balance, never below zero.
    pub balance: i64,
}

/// Accounts relate to nothing here.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
