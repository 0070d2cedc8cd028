//! freshlock's own tables, as a sea-orm migration to add to your `Migrator`.
//!
//! - `freshlock_lock` — one row per lock name, never deleted: owner token, lease expiry (database
//!   clock, milliseconds since the Unix epoch), fence counter, and who holds it (host, pid, label,
//!   acquired-at). The [`TableLock`](crate::lock::TableLock) backend leases these rows; the
//!   other lease backends keep their fence counters here.
//! - `freshlock_claim` — claims with a lease ([`crate::claim::Claims`]).
//! - `freshlock_row_lock` — one row per lock name, locked with `SELECT … FOR UPDATE` by the
//!   [`RowLock`](crate::lock::RowLock) backend (the Django report's `HamLock`).

use sea_orm::{ConnectionTrait, DbErr};
use sea_orm_migration::{
    MigrationName, MigrationTrait, SchemaManager,
    prelude::{DeriveIden, Table},
    schema::{big_integer, big_integer_null, string_len, string_len_null},
    sea_query::TableCreateStatement,
};

/// The name of the lease table.
pub const LOCK_TABLE: &str = "freshlock_lock";
/// The name of the lock-row table.
pub const ROW_LOCK_TABLE: &str = "freshlock_row_lock";
/// The name of the claims table.
pub const CLAIM_TABLE: &str = "freshlock_claim";
/// The name of the migration that creates them, as it appears in `seaql_migrations`.
pub const MIGRATION_NAME: &str = "m20261130_000100_create_freshlock_tables";
/// Longest lock name stored as it is; longer ones are stored as prefix + hash.
pub(crate) const MAX_STORED_NAME: usize = 255;

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

fn claim_table() -> TableCreateStatement {
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

fn lock_table() -> TableCreateStatement {
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

fn row_lock_table() -> TableCreateStatement {
    Table::create()
        .table(FreshlockRowLock::Table)
        .if_not_exists()
        .col(string_len(FreshlockRowLock::Name, MAX_STORED_NAME as u32).primary_key())
        .to_owned()
}

/// The migration that creates the lease and lock-row tables. Add [`migrations`] to your
/// `Migrator`'s list (it has this one and [`ClaimMigration`]).
pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        MIGRATION_NAME
    }
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager.create_table(lock_table()).await?;
        manager.create_table(row_lock_table()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(FreshlockClaim::Table)
                    .if_exists()
                    .to_owned(),
            )
            .await?;
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
}

/// The name of the migration that creates the claims table.
pub const CLAIM_MIGRATION_NAME: &str = "m20261130_000200_create_freshlock_claim";

/// The migration that creates `freshlock_claim` (claims with a lease).
pub struct ClaimMigration;

impl MigrationName for ClaimMigration {
    fn name(&self) -> &str {
        CLAIM_MIGRATION_NAME
    }
}

#[async_trait::async_trait]
impl MigrationTrait for ClaimMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager.create_table(claim_table()).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(
                Table::drop()
                    .table(FreshlockClaim::Table)
                    .if_exists()
                    .to_owned(),
            )
            .await
    }
}

/// All of freshlock's migrations, oldest first: append them to your `Migrator`'s list.
pub fn migrations() -> Vec<Box<dyn MigrationTrait>> {
    vec![Box::new(Migration), Box::new(ClaimMigration)]
}

/// Creates freshlock's tables if they do not exist, without the migration machinery (for tests
/// and tools; applications should prefer [`Migration`]).
///
/// # Errors
/// The database's error when a statement fails.
pub async fn create_tables(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    db.execute(&lock_table()).await?;
    db.execute(&row_lock_table()).await?;
    db.execute(&claim_table()).await?;
    Ok(())
}
