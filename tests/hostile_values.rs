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
