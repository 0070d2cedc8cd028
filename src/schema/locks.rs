//! The first migration: `freshlock_lock` (leases, fences, holders) and `freshlock_row_lock`.

use super::{LOCK_TABLE, MAX_STORED_NAME, ROW_LOCK_TABLE, lease_row::lease_table};
use sea_orm::{ConnectionTrait, DbErr};
use sea_orm_migration::{
    prelude::{DeriveIden, Table},
    schema::string_len,
    sea_query::TableCreateStatement,
};

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

super::freshlock_migration! {
    /// The name of the migration that creates them, as it appears in `seaql_migrations`.
    const MIGRATION_NAME = "m20261130_000100_create_freshlock_tables";
    /// The migration that creates the lease and lock-row tables. Add [`migrations`](super::migrations) to your
    /// `Migrator`'s list (it has this one, [`ClaimMigration`](super::ClaimMigration) and [`CommitMigration`](super::CommitMigration)).
    struct Migration { up: create_lock_tables, drops: [ROW_LOCK_TABLE, LOCK_TABLE] }
}

/// Creates the lease and lock-row tables unless they exist.
pub(super) async fn create_lock_tables(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    db.execute(&lock_table()).await?;
    db.execute(&row_lock_table()).await.map(drop)
}
