//! What both benchmark binaries share: the databases and the two operations they compare.
#![allow(dead_code)]

use entity::node;
use freshlock::Session;
use migration::{Migrator, MigratorTrait};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, EntityTrait,
    IntoActiveModel, IsolationLevel, QuerySelect, Set, SqliteTransactionMode, TransactionOptions,
    TransactionTrait,
};

pub async fn connect(url: &str, max: u32) -> DatabaseConnection {
    connect_with(url, max, true).await
}

/// [`connect`], saying whether the pool pings a connection when it is checked out (sqlx's
/// `test_before_acquire`, on by default: one round trip per transaction).
pub async fn connect_with(url: &str, max: u32, ping: bool) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url);
    options
        .test_before_acquire(ping)
        .max_connections(max)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .sqlx_logging(false);
    Database::connect(options).await.expect("connect")
}

/// A database with `n` nodes. Server databases are emptied first.
pub async fn database(url: &str, n: i32, pool: u32) -> DatabaseConnection {
    database_with(url, n, pool, true).await
}

/// [`database`], saying whether the pool pings a connection when it is checked out.
pub async fn database_with(url: &str, n: i32, pool: u32, ping: bool) -> DatabaseConnection {
    let db = connect_with(url, pool, ping).await;
    Migrator::up(&db, None).await.expect("migrate");
    node::Entity::delete_many().exec(&db).await.expect("empty");
    db.execute_unprepared("DELETE FROM freshlock_lock WHERE name <> ''")
        .await
        .expect("empty locks");
    let rows: Vec<_> = (1..=n).map(node::ActiveModel::fresh).collect();
    for chunk in rows.chunks(500) {
        node::Entity::insert_many(chunk.to_vec())
            .exec(&db)
            .await
            .expect("seed");
    }
    db
}

pub async fn increment(session: &Session, id: i32) {
    increment_reported(session, id).await;
}

/// [`increment`], returning how many writes its commit carried (`Report::batch`).
pub async fn increment_reported(session: &Session, id: i32) -> u32 {
    let report = session
        .repository::<node::Entity>()
        .locked_update(id, |n| {
            let score = n.score.as_ref().unwrap_or(0);
            n.score = Set(Some(score + 1));
            Ok(())
        })
        .await
        .expect("locked_update");
    assert!(report.outcome.is_updated());
    report.batch
}

/// The minimal hand-written transaction: BEGIN (IMMEDIATE on SQLite), SELECT (FOR UPDATE
/// elsewhere), UPDATE of the one column, COMMIT.
pub async fn hand_written(db: &DatabaseConnection, id: i32) {
    let options = if db.get_database_backend() == DbBackend::Sqlite {
        TransactionOptions {
            sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
            ..Default::default()
        }
    } else {
        TransactionOptions {
            isolation_level: Some(IsolationLevel::ReadCommitted),
            ..Default::default()
        }
    };
    statements_in(db, id, options).await;
}

/// pgbench's four statements in sea-orm: a plain `BEGIN` (no `SET TRANSACTION`), `SELECT … FOR
/// UPDATE`, the UPDATE of one column, `COMMIT`.
pub async fn four_statements(db: &DatabaseConnection, id: i32) {
    statements_in(db, id, TransactionOptions::default()).await;
}

/// The hand-written transaction's statements, begun with `options`.
async fn statements_in(db: &DatabaseConnection, id: i32, options: TransactionOptions) {
    let txn = db.begin_with_options(options).await.expect("begin");
    let mut select = node::Entity::find_by_id(id);
    if db.get_database_backend() != DbBackend::Sqlite {
        select = select.lock_exclusive();
    }
    let model = select.one(&txn).await.expect("select").expect("row");
    let score = model.score.unwrap_or(0);
    let mut am = model.into_active_model();
    am.score = Set(Some(score + 1));
    node::Entity::update(am)
        .exec_without_returning(&txn)
        .await
        .expect("update");
    txn.commit().await.expect("commit");
}
