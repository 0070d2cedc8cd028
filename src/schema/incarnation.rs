//! `freshlock_incarnation` (PostgreSQL): the token of the server's current incarnation.

use super::INCARNATION_TABLE;
use sea_orm::{ConnectionTrait, DbErr};

super::freshlock_migration! {
    /// The name of the migration that adds PostgreSQL's server-incarnation table.
    const INCARNATION_MIGRATION_NAME = "m20261201_000500_freshlock_incarnation";
    /// On PostgreSQL, the migration that creates `freshlock_incarnation`: an `UNLOGGED` table that
    /// holds one row, the token of the server's current incarnation (written by the first locked
    /// write that finds it empty). PostgreSQL empties unlogged tables in crash recovery (and a
    /// promoted standby starts with them empty), which are exactly the events after which a
    /// transaction id can be handed out a second time. A write whose transaction saw token `t` and
    /// got id `x` is therefore resolved by `txid_status(x)` only while `t` is still the row's token;
    /// afterwards its outcome is unknown, never guessed. With this table a PostgreSQL write needs
    /// no marker row (see `freshlock::commit` in the crate's source); without it, writes keep
    /// writing markers. Nothing on MySQL/MariaDB and SQLite.
    struct IncarnationMigration { up: create_incarnation_table, drops: [INCARNATION_TABLE] }
}

/// `CREATE UNLOGGED TABLE IF NOT EXISTS freshlock_incarnation` on PostgreSQL; nothing elsewhere.
pub(super) async fn create_incarnation_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    if db.get_database_backend() != sea_orm::DbBackend::Postgres {
        return Ok(());
    }
    db.execute_unprepared(&format!(
        "CREATE UNLOGGED TABLE IF NOT EXISTS {INCARNATION_TABLE} \
         (id INTEGER PRIMARY KEY CHECK (id = 1), token VARCHAR(64) NOT NULL)"
    ))
    .await
    .map(drop)
}
