//! `freshlock_periodic`: the last slot of each periodic kind that was enqueued
//! ([`crate::jobs::Periodic`]).

use sea_orm::{ConnectionTrait, DbErr};

use super::PERIODIC_TABLE;

super::freshlock_migration! {
    /// The name of the migration that adds the periodic-slot table.
    const PERIODIC_MIGRATION_NAME = "m20261205_000800_freshlock_periodic";
    /// The migration that creates `freshlock_periodic`: one row per periodic kind (its SHA-256,
    /// and the kind as bytes), holding the last slot enqueued, in milliseconds since the Unix
    /// epoch. A worker enqueues a slot's job only by moving that row forward, in the transaction
    /// of the enqueue: so each slot is enqueued once across every process, and across restarts.
    struct PeriodicMigration { up: create_periodic_table, drops: [PERIODIC_TABLE] }
}

/// `CREATE TABLE IF NOT EXISTS freshlock_periodic`, per dialect.
pub(super) async fn create_periodic_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    super::statements::create_kind_table(db, PERIODIC_TABLE, "slot").await
}
