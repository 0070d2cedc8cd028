//! The fence floor: the row of `freshlock_lock` whose fence every new name starts above.

use super::{FLOOR_NAME, LOCK_TABLE, insert_ignore};
use sea_orm::{ConnectionTrait, DbErr};

super::freshlock_migration! {
    /// The name of the migration that adds the fence floor.
    const FLOOR_MIGRATION_NAME = "m20261130_000400_freshlock_lock_floor";
    /// The migration that adds the fence-floor row to `freshlock_lock` (see the module docs), so
    /// that lock rows nobody needs can be deleted without a name's fences ever going back. Without
    /// it the floor is taken as 0 (and created by the first [`crate::inspect::compact`]); on
    /// MySQL/MariaDB a present floor row also keeps new names' first grants from gap-locking.
    struct FloorMigration { up: insert_floor, drops: [] }
}

/// Inserts the fence-floor row at 0 unless it is there. Its step down drops nothing: removing
/// the floor could let a deleted name's fences start over.
pub(crate) async fn insert_floor(db: &impl ConnectionTrait) -> Result<(), DbErr> {
    let backend = db.get_database_backend();
    let insert = insert_ignore(
        backend,
        LOCK_TABLE,
        "name, fence, expires_at",
        &format!("'{FLOOR_NAME}', 0, 0"),
    );
    db.execute_raw(sea_orm::Statement::from_string(backend, insert))
        .await
        .map(drop)
}
