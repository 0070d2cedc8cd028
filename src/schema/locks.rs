//! The first migration: `freshlock_lock` (leases, fences, holders) and `freshlock_row_lock`.

use super::MAX_STORED_NAME;
use sea_orm::DbErr;
use sea_orm_migration::{
    SchemaManager,
    prelude::{DeriveIden, Table},
    schema::{big_integer, big_integer_null, string_len, string_len_null},
    sea_query::TableCreateStatement,
};

#[derive(DeriveIden)]
enum FreshlockLock {
    Table,
    Name,
    Owner,
    Fence,
    ExpiresAt,
    Host,
    Pid,
    Label,
    AcquiredAt,
}

#[derive(DeriveIden)]
enum FreshlockRowLock {
    Table,
    Name,
}

pub(super) fn lock_table() -> TableCreateStatement {
    Table::create()
        .table(FreshlockLock::Table)
        .if_not_exists()
        .col(string_len(FreshlockLock::Name, MAX_STORED_NAME as u32).primary_key())
        .col(string_len_null(FreshlockLock::Owner, 64))
        .col(big_integer(FreshlockLock::Fence).default(0))
        .col(big_integer(FreshlockLock::ExpiresAt).default(0))
        .col(string_len_null(FreshlockLock::Host, 255))
        .col(big_integer_null(FreshlockLock::Pid))
        .col(string_len_null(FreshlockLock::Label, 255))
        .col(big_integer_null(FreshlockLock::AcquiredAt))
        .to_owned()
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
