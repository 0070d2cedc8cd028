//! Statements the migrations share: an insert that keeps an existing row, an index made once.

use sea_orm::{ConnectionTrait, DbErr};

/// `INSERT … ` that does nothing when the key exists.
pub(crate) fn insert_ignore(
    backend: sea_orm::DbBackend,
    table: &str,
    columns: &str,
    values: &str,
) -> String {
    match backend {
        sea_orm::DbBackend::MySql => {
            format!("INSERT IGNORE INTO {table} ({columns}) VALUES ({values})")
        }
        _ => format!("INSERT INTO {table} ({columns}) VALUES ({values}) ON CONFLICT DO NOTHING"),
    }
}

/// `CREATE INDEX index ON table (columns)` unless `table` has an index of that name.
pub(super) async fn create_index(
    db: &impl ConnectionTrait,
    table: &str,
    index: &str,
    columns: &str,
) -> Result<(), DbErr> {
    let backend = db.get_database_backend();
    let create = if backend == sea_orm::DbBackend::MySql {
        // MySQL has no `IF NOT EXISTS` for indexes (MariaDB has): look first.
        let exists = db
            .query_one_raw(sea_orm::Statement::from_sql_and_values(
                backend,
                "SELECT 1 AS one FROM information_schema.statistics \
                 WHERE table_schema = DATABASE() AND table_name = ? AND index_name = ?",
                [table.into(), index.into()],
            ))
            .await?
            .is_some();
        if exists {
            return Ok(());
        }
        format!("CREATE INDEX {index} ON {table} ({columns})")
    } else {
        format!("CREATE INDEX IF NOT EXISTS {index} ON {table} ({columns})")
    };
    db.execute_unprepared(&create).await.map(drop)
}

/// `DROP TABLE IF EXISTS` each of `tables`, in order.
pub(super) async fn drop_tables(db: &impl ConnectionTrait, tables: &[&str]) -> Result<(), DbErr> {
    for table in tables {
        db.execute_unprepared(&format!("DROP TABLE IF EXISTS {table}"))
            .await?;
    }
    Ok(())
}

/// `CREATE TABLE IF NOT EXISTS table` of one row per job kind: the kind's SHA-256 (the key),
/// the kind as bytes, and one `BIGINT` `column` (the periodic table's last slot, the worker-kind
/// table's last say), per dialect.
pub(super) async fn create_kind_table(
    db: &impl ConnectionTrait,
    table: &str,
    column: &str,
) -> Result<(), DbErr> {
    let (bytes, hash, tail) = match db.get_database_backend() {
        sea_orm::DbBackend::Postgres => ("BYTEA", "BYTEA", ""),
        sea_orm::DbBackend::MySql => ("LONGBLOB", "BINARY(32)", " ENGINE=InnoDB"),
        _ => ("BLOB", "BLOB", ""),
    };
    db.execute_unprepared(&format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
         kind_hash {hash} NOT NULL PRIMARY KEY, \
         kind {bytes} NOT NULL, \
         {column} BIGINT NOT NULL){tail}"
    ))
    .await
    .map(drop)
}
