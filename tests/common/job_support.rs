//! What the job tests share: the effect their handlers write, and one test per database.
#![allow(dead_code, unused_macros)]

use sea_orm::{ConnectionTrait, Statement};

/// The effect a job of the tests has: node `node`'s score plus one, in the job's transaction.
/// The node scores add up to the effects in the database, to count against the jobs.
pub async fn bump(tx: &freshlock::Tx, node: i32) -> Result<(), sea_orm::DbErr> {
    let backend = tx.get_database_backend();
    let sql = if backend == sea_orm::DbBackend::Postgres {
        "UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = $1"
    } else {
        "UPDATE node SET score = COALESCE(score, 0) + 1 WHERE id = ?"
    };
    tx.execute_raw(Statement::from_sql_and_values(backend, sql, [node.into()]))
        .await
        .map(drop)
}

/// One multi-threaded test per line `name: scenario, database;`, running
/// `scenario(databases::database("name").await)`; the scenario skips on `None` (no URL).
/// Invoke it where `databases` is in scope.
macro_rules! on_databases {
    ($($test:ident: $scenario:ident, $db:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            $scenario(databases::$db(stringify!($test)).await).await;
        }
    )*};
}
