//! The first migration: `freshlock_lock` (leases, fences, holders) and `freshlock_row_lock`.

use super::{LOCK_TABLE, MAX_STORED_NAME, lease_row::lease_table};
use sea_orm::DbErr;
use sea_orm_migration::{
    SchemaManager,
    prelude::{DeriveIden, Table},
    schema::string_len,
    sea_query::TableCreateStatement,
};

#[derive(DeriveIden)]
enum FreshlockLock {
    Table,
}

#[derive(DeriveIden)]
enum FreshlockRowLock {
    Table,
    Name,
}

pub(super) fn lock_table() -> TableCreateStatement {
    lease_table(LOCK_TABLE, false, "acquired_at")
}

pub(super) fn row_lock_table() -> TableCreateStatement {
    Table::create()
        .table(FreshlockRowLock::Table)
        .if_not_exists()
        .col(string_len(FreshlockRowLock::Name, MAX_STORED_NAME as u32).primary_key())
        .to_owned()
}

super::migration! {
    /// The name of the migration that creates them, as it appears in `seaql_migrations`.
    const MIGRATION_NAME = "m20261130_000100_create_freshlock_tables";
    /// The migration that creates the lease and lock-row tables. Add [`migrations`](super::migrations) to your
    /// `Migrator`'s list (it has this one, [`ClaimMigration`](super::ClaimMigration) and [`CommitMigration`](super::CommitMigration)).
    struct Migration { up: up, down: down }
}

/// `Migration`'s step up.
async fn up(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    manager.create_table(lock_table()).await?;
    manager.create_table(row_lock_table()).await
}

/// `Migration`'s step down.
async fn down(manager: &SchemaManager<'_>) -> Result<(), DbErr> {
    manager
        .drop_table(
            Table::drop()
                .table(FreshlockRowLock::Table)
                .if_exists()
                .to_owned(),
        )
        .await?;
    manager
        .drop_table(
            Table::drop()
                .table(FreshlockLock::Table)
                .if_exists()
                .to_owned(),
        )
        .await
}
