//! `node`: one row per content node, one column per worker of the Drupal report.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Node::Table)
                    .if_not_exists()
                    .col(pk_auto(Node::Id))
                    .col(string(Node::Title))
                    .col(string_null(Node::Thumbnail))
                    .col(text_null(Node::Summary))
                    .col(integer_null(Node::Score))
                    .col(text_null(Node::Analysis))
                    .col(big_integer(Node::Changed).default(0))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Node::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum Node {
    Table,
    Id,
    Title,
    Thumbnail,
    Summary,
    Score,
    Analysis,
    Changed,
}
