//! `freshlock_claim`: claims with a lease ([`crate::claim::Claims`]).

use super::{CLAIM_TABLE, lease_row::lease_table};
use sea_orm::{ConnectionTrait, DbErr};
use sea_orm_migration::{
    prelude::DeriveIden, schema::big_integer_null, sea_query::TableCreateStatement,
};

#[derive(DeriveIden)]
enum FreshlockClaim {
    FinishedAt,
}

pub(super) fn claim_table() -> TableCreateStatement {
    lease_table(CLAIM_TABLE, true, "claimed_at")
        .col(big_integer_null(FreshlockClaim::FinishedAt))
        .to_owned()
}

super::freshlock_migration! {
    /// The name of the migration that creates the claims table.
    const CLAIM_MIGRATION_NAME = "m20261130_000200_create_freshlock_claim";
    /// The migration that creates `freshlock_claim` (claims with a lease).
    struct ClaimMigration { up: create_claim_table, drops: [CLAIM_TABLE] }
}

/// Creates `freshlock_claim` unless it exists.
pub(super) async fn create_claim_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    db.execute(&claim_table()).await.map(drop)
}
