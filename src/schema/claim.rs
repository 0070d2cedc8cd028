//! `freshlock_claim`: claims with a lease ([`crate::claim::Claims`]).

use super::{CLAIM_TABLE, lease_row::lease_table};
use sea_orm::DbErr;
use sea_orm_migration::{
    SchemaManager,
    prelude::{DeriveIden, Table},
    schema::big_integer_null,
    sea_query::TableCreateStatement,
};

#[derive(DeriveIden)]
enum FreshlockClaim {
    Table,
    FinishedAt,
}

pub(super) fn claim_table() -> TableCreateStatement {
    lease_table(CLAIM_TABLE, true, "claimed_at")
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
