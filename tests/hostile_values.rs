//! Values that break hand-built SQL go through every write path intact: quotes, backslashes,
//! `$1` / `?` placeholders and statement separators inside strings, and NUL.
//!
//! Each value is written by `locked_update` (the locked path, whose PostgreSQL UPDATE also
//! returns the transaction id), through a session that combines commits (`combine_commits`,
//! the merged draft) and by the one-statement optimistic write (`optimistic_first`), then read
//! back byte for byte. PostgreSQL refuses NUL in
//! text: there the write fails with a database error and nothing changes; MariaDB and SQLite
//! store it.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::sync::Arc;

use entity::node;
use freshlock::{Error, LocalLock, Session};
use sea_orm::{DbBackend, EntityTrait, Set};
use servers::{TestDb, databases};

const HOSTILE: [&str; 8] = [
    "O'Brien",
    "it''s",
    "back\\slash\\",
    "\\'; DROP TABLE node; --",
    "$1 $2 ? :id",
    "line\nbreak\ttab",
    "unicode ✓ 日本",
    "NUL\0byte",
];

fn sessions(db: &sea_orm::DatabaseConnection) -> Vec<(&'static str, Session)> {
    let build = |combine: bool, optimistic: bool| {
        Session::builder(db.clone())
            .lock(Arc::new(LocalLock::new()))
            .version_column::<node::Entity>(node::Column::Changed)
            .combine_commits(combine)
            .optimistic_first(optimistic)
            .build()
            .expect("session")
    };
    vec![
        ("locked", build(false, false)),
        ("combined", build(true, false)),
        ("optimistic", build(false, true)),
    ]
}

async fn hostile(db: Option<TestDb>, _: ()) {
    let Some(test) = db else { return };
    let db = &test.db;
    test.seed_nodes(1).await;
    let refuses_nul = db.get_database_backend() == DbBackend::Postgres;
    for (path, session) in sessions(db) {
        let nodes = session.repository::<node::Entity>();
        // The optimistic path needs the row cached.
        nodes.load(1).await.expect("load");
        for value in HOSTILE {
            let before = node::Entity::find_by_id(1)
                .one(db)
                .await
                .expect("read")
                .expect("row");
            let result = nodes
                .locked_update(1, |n| {
                    n.title = Set(value.to_owned());
                    n.summary = Set(Some(format!("{value}|{value}")));
                    Ok(())
                })
                .await;
            let after = node::Entity::find_by_id(1)
                .one(db)
                .await
                .expect("read")
                .expect("row");
            if refuses_nul && value.contains('\0') {
                assert!(
                    matches!(result, Err(Error::Database { .. })),
                    "{path}: {result:?}"
                );
                assert_eq!(after, before, "{path}: nothing changed");
                continue;
            }
            let report = result.unwrap_or_else(|e| panic!("{path} {value:?}: {e}"));
            let stored = report.outcome.model().expect("written").clone();
            assert_eq!(after.title, value, "{path}");
            assert_eq!(
                after.summary.as_deref(),
                Some(format!("{value}|{value}").as_str())
            );
            assert_eq!(*stored, after, "{path}: the report holds the row as stored");
            assert_eq!(after.changed, before.changed + 1, "{path}: one write");
        }
    }
    let count = node::Entity::find().all(db).await.expect("rows").len();
    assert_eq!(count, 1, "no statement ran that was not ours");
}

servers::server_tests! {
    hostile_sqlite: hostile, (), sqlite;
    hostile_postgres: hostile, (), postgres;
    hostile_mysql: hostile, (), mysql;
}

/// `mysql_named` sends `GET_LOCK` and the read of its fence row as one message of two
/// statements, which cannot be prepared: the lock's names travel in the SQL text (hexadecimal
/// literals). Each hostile name — under the server's `sql_mode` and under
/// `NO_BACKSLASH_ESCAPES` and `ANSI_QUOTES`, which change how escaped string literals read — is
/// granted and released as the very name a bound parameter names (`IS_FREE_LOCK(?)`), and the
/// grant reads (and waits for) the row its checked transactions bump under that name, byte for
/// byte: a transaction holding that row makes the grant wait.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn hostile_lock_names_mysql_named() {
    use std::time::Duration;

    use freshlock::{LeaseLock, LockName, MySqlNamedLock};
    use sea_orm::{ConnectionTrait, Statement, TransactionTrait};

    let Some(test) = servers::mysql("hostile_lock_names").await else {
        return;
    };
    let other = servers::connect(&test.url, None, 1).await;
    let bound = |sql: &str, name: &str| {
        Statement::from_sql_and_values(DbBackend::MySql, sql, [name.into()])
    };
    let free = |name: String| {
        let other = other.clone();
        async move {
            let row = other
                .query_one_raw(bound("SELECT IS_FREE_LOCK(?) AS free", &name))
                .await
                .expect("IS_FREE_LOCK")
                .expect("a row");
            row.try_get::<i64>("", "free").expect("free") == 1
        }
    };
    let mut fences = std::collections::HashMap::new();
    for mode in ["", ",NO_BACKSLASH_ESCAPES,ANSI_QUOTES"] {
        // One connection, so that every grant runs under the session's mode.
        let locks = servers::connect(&test.url, None, 1).await;
        let set = format!("SET SESSION sql_mode = CONCAT(@@sql_mode, '{mode}')");
        locks.execute_unprepared(&set).await.expect("sql_mode");
        let lock = MySqlNamedLock::new(locks).expect("MySQL");
        for value in HOSTILE {
            let name = LockName::new(value).expect("a name");
            let guard = lock
                .acquire(&name, Duration::ZERO, Duration::from_secs(60))
                .await
                .expect("acquire")
                .expect("granted: nobody else holds it");
            assert_eq!(guard.fence(), Some(0), "issued by a checked transaction");
            let txn = other.begin().await.expect("begin");
            assert!(
                guard.verify(&txn).await.expect("verify"),
                "{value:?} {mode}: held"
            );
            txn.commit().await.expect("commit");
            let fence = guard.fence().expect("a fence");
            let last = fences.insert(value, fence);
            assert_eq!(
                fence,
                last.map_or(fence, |last| last + 1),
                "{value:?}: each checked transaction bumps the fence"
            );
            // Names of ASCII that fit 64 bytes are the server's lock names themselves.
            let server_name = value.is_ascii().then(|| value.to_owned());
            if let Some(server_name) = &server_name {
                assert!(!free(server_name.clone()).await, "{value:?} {mode}: held");
            }
            let stored = other
                .query_one_raw(bound(
                    "SELECT fence FROM freshlock_lock WHERE name = ?",
                    value,
                ))
                .await
                .expect("fence row")
                .unwrap_or_else(|| panic!("{value:?} {mode}: stored under its name"));
            assert_eq!(stored.try_get::<i64>("", "fence").unwrap(), fence as i64);
            guard.release().await.expect("release");
            // A transaction holding the name's fence row: a grant of the name waits for it
            // (its read found the row the hex literal names), and is had once it ended.
            let holder = other.begin().await.expect("begin");
            holder
                .execute_raw(bound(
                    "SELECT fence FROM freshlock_lock WHERE name = ? FOR UPDATE",
                    value,
                ))
                .await
                .expect("fence row locked");
            let waiting = {
                let (lock, name) = (lock.clone(), name.clone());
                tokio::spawn(async move {
                    lock.acquire(&name, Duration::ZERO, Duration::from_secs(60))
                        .await
                })
            };
            // Seen waiting in its read of the row (MariaDB lists a wait in a constant table's
            // read in no lock view: the process list shows it).
            test.until(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE info LIKE \
                 'SELECT fence FROM freshlock_lock WHERE name = CONVERT(%' \
                 AND id <> CONNECTION_ID()",
                &format!("{value:?} {mode}: the grant waits for the fence row"),
            )
            .await;
            assert!(
                !waiting.is_finished(),
                "{value:?} {mode}: granted while the row is held"
            );
            holder.rollback().await.expect("rollback");
            let guard = waiting
                .await
                .expect("join")
                .expect("acquire")
                .expect("granted after the wait");
            guard.release().await.expect("release");
            if let Some(server_name) = server_name {
                assert!(free(server_name).await, "{value:?} {mode}: released");
            }
        }
    }
    let rows = other
        .query_one_raw(Statement::from_string(
            DbBackend::MySql,
            "SELECT COUNT(*) AS n FROM freshlock_lock WHERE name <> ''",
        ))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rows.try_get::<i64>("", "n").unwrap(), HOSTILE.len() as i64);
}
