//! `freshlock_commit` (commit markers) and exact, byte-for-byte names on MySQL/MariaDB.

use super::{CLAIM_TABLE, COMMIT_TABLE, LOCK_TABLE, MAX_STORED_NAME, ROW_LOCK_TABLE};
use sea_orm::{ConnectionTrait, DbErr};
use sea_orm_migration::{
    prelude::{DeriveIden, Table},
    schema::{big_integer, string_len},
    sea_query::TableCreateStatement,
};

#[derive(DeriveIden)]
enum FreshlockCommit {
    Table,
    Token,
    CreatedAt,
}

pub(super) fn commit_table() -> TableCreateStatement {
    Table::create()
        .table(FreshlockCommit::Table)
        .if_not_exists()
        .col(string_len(FreshlockCommit::Token, 64).primary_key())
        .col(big_integer(FreshlockCommit::CreatedAt))
        .to_owned()
}

super::freshlock_migration! {
    /// The name of the migration that adds commit markers and byte-exact names.
    const COMMIT_MIGRATION_NAME = "m20261130_000300_freshlock_commit_and_exact_names";
    /// The migration that creates `freshlock_commit` (the markers that resolve a commit whose reply
    /// was lost) and, on MySQL/MariaDB, makes every name and token column of freshlock's tables
    /// compare byte for byte: their default collation there ignores case, accents and trailing
    /// spaces, so `job:A`, `job:a`, `job:é` and `job:e  ` would be one claim, one lease, one fence.
    /// Existing tables are converted in place (a binary comparison never merges rows).
    struct CommitMigration { up: create_commit_table, drops: [COMMIT_TABLE] }
}

/// Creates `freshlock_commit` unless it exists, and makes the names byte-exact. Its step down
/// drops the table; the names stay byte-exact (going back to a collation that merges names could
/// fail on rows that are distinct only byte for byte).
pub(super) async fn create_commit_table(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    db.execute(&commit_table()).await?;
    exact_names(db).await
}

/// On MySQL/MariaDB, a binary NO PAD collation for every name and token column: MariaDB's
/// `utf8mb4_nopad_bin`, MySQL 8's `utf8mb4_0900_bin` (`utf8mb4_bin` still pads trailing spaces).
async fn exact_names(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    if db.get_database_backend() != sea_orm::DbBackend::MySql {
        return Ok(());
    }
    let version = db
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::MySql,
            "SELECT VERSION() AS v",
        ))
        .await?
        .map(|row| row.try_get::<String>("", "v"))
        .transpose()?
        .unwrap_or_default();
    let collation = if version.contains("MariaDB") {
        "utf8mb4_nopad_bin"
    } else {
        "utf8mb4_0900_bin"
    };
    let text = |column: &str, len: u32, null: &str| {
        format!("MODIFY {column} VARCHAR({len}) CHARACTER SET utf8mb4 COLLATE {collation} {null}")
    };
    let max = MAX_STORED_NAME as u32;
    for (table, columns) in [
        (
            LOCK_TABLE,
            vec![text("name", max, "NOT NULL"), text("owner", 64, "NULL")],
        ),
        (ROW_LOCK_TABLE, vec![text("name", max, "NOT NULL")]),
        (
            CLAIM_TABLE,
            vec![text("name", max, "NOT NULL"), text("owner", 64, "NULL")],
        ),
        (COMMIT_TABLE, vec![text("token", 64, "NOT NULL")]),
    ] {
        db.execute_unprepared(&format!("ALTER TABLE {table} {}", columns.join(", ")))
            .await?;
    }
    Ok(())
}
