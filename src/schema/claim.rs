//! `freshlock_claim`: claims with a lease ([`crate::claim::Claims`]).

use super::MAX_STORED_NAME;
use sea_orm::DbErr;
use sea_orm_migration::{
    SchemaManager,
    prelude::{DeriveIden, Table},
    schema::{big_integer, big_integer_null, string_len, string_len_null},
    sea_query::TableCreateStatement,
};

#[derive(DeriveIden)]
enum FreshlockClaim {
    Table,
    Name,
    State,
    Owner,
    Fence,
    ExpiresAt,
    Host,
    Pid,
    Label,
    ClaimedAt,
    FinishedAt,
}

pub(super) fn claim_table() -> TableCreateStatement {
    Table::create()
        .table(FreshlockClaim::Table)
        .if_not_exists()
        .col(string_len(FreshlockClaim::Name, MAX_STORED_NAME as u32).primary_key())
        .col(string_len(FreshlockClaim::State, 16))
        .col(string_len_null(FreshlockClaim::Owner, 64))
        .col(big_integer(FreshlockClaim::Fence).default(0))
        .col(big_integer(FreshlockClaim::ExpiresAt).default(0))
        .col(string_len_null(FreshlockClaim::Host, 255))
        .col(big_integer_null(FreshlockClaim::Pid))
        .col(string_len_null(FreshlockClaim::Label, 255))
        .col(big_integer_null(FreshlockClaim::ClaimedAt))
        .col(big_integer_null(FreshlockClaim::FinishedAt))
        .to_owned()
}

super::migration! {
    /// The name of the migration that creates the claims table.
    const CLAIM_MIGRATION_NAME = "m20261130_000200_create_freshlock_claim";
    /// The migration that creates `freshlock_claim` (claims with a lease).
    struct ClaimMigration { up: up, down: down }
}

/// `ClaimMigration`'s step up.
async fn up(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    manager.create_table(claim_table()).await
}

/// `ClaimMigration`'s step down.
async fn down(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    manager
        .drop_table(
            Table::drop()
                .table(FreshlockClaim::Table)
                .if_exists()
                .to_owned(),
        )
        .await
}
