//! `ham`, `spam` and the 1:1 `ham_lock` of the Django report.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Ham::Table)
                    .if_not_exists()
                    .col(pk_auto(Ham::Id))
                    .col(string(Ham::Name))
                    .col(big_integer(Ham::UpdatedAt).default(0))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(Spam::Table)
                    .if_not_exists()
                    .col(pk_auto(Spam::Id))
                    .col(integer(Spam::HamId))
                    .col(string_len(Spam::State, 32).default("new"))
                    .col(big_integer(Spam::UpdatedAt).default(0))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_spam_ham")
                            .from(Spam::Table, Spam::HamId)
                            .to(Ham::Table, Ham::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("idx_spam_ham_id")
                    .table(Spam::Table)
                    .col(Spam::HamId)
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(HamLock::Table)
                    .if_not_exists()
                    .col(integer(HamLock::HamId).primary_key())
                    .col(big_integer(HamLock::UpdatedAt).default(0))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_ham_lock_ham")
                            .from(HamLock::Table, HamLock::HamId)
                            .to(Ham::Table, Ham::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            HamLock::Table.into_iden(),
            Spam::Table.into_iden(),
            Ham::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).if_exists().to_owned())
                .await?;
        }
        Ok(())
    }
}

#[derive(DeriveIden)]
enum Ham {
    Table,
    Id,
    Name,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum Spam {
    Table,
    Id,
    HamId,
    State,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum HamLock {
    Table,
    HamId,
    UpdatedAt,
}
