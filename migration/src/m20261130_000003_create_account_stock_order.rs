//! `account`, `stock` and `purchase_order`: the multi-row examples.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(BankAccount::Table)
                    .if_not_exists()
                    .col(integer(BankAccount::Id).primary_key())
                    .col(big_integer(BankAccount::Balance).default(0))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Stock::Table)
                    .if_not_exists()
                    .col(integer(Stock::Id).primary_key())
                    .col(integer(Stock::Quantity).default(0))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(PurchaseOrder::Table)
                    .if_not_exists()
                    .col(big_integer(PurchaseOrder::Id).primary_key())
                    .col(integer(PurchaseOrder::StockId))
                    .col(integer(PurchaseOrder::Quantity))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            PurchaseOrder::Table.into_iden(),
            Stock::Table.into_iden(),
            BankAccount::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).if_exists().to_owned())
                .await?;
        }
        Ok(())
    }
}

#[derive(DeriveIden)]
enum BankAccount {
    Table,
    Id,
    Balance,
}

#[derive(DeriveIden)]
enum Stock {
    Table,
    Id,
    Quantity,
}

#[derive(DeriveIden)]
enum PurchaseOrder {
    Table,
    Id,
    StockId,
    Quantity,
}
