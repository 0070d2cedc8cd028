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
use freshlock::lock::LocalLock;
use freshlock::{Error, Session};
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
    let build = |combine: bool, optimistic: bool, versioned: bool| {
        let mut builder = Session::builder(db.clone())
            .lock(Arc::new(LocalLock::new()))
            .combine_commits(combine)
            .optimistic_first(optimistic)
            // Two flights on PostgreSQL for the locked paths (values written in).
            .two_flights(!optimistic);
        if versioned {
            builder = builder.version_column::<node::Entity>(node::Column::Changed);
        }
        builder.build().expect("session")
    };
    vec![
        ("locked", build(false, false, true)),
        // The guard compares the columns written with what was read: the hostile values are
        // in the UPDATE's WHERE too.
        ("unversioned", build(false, false, false)),
        ("combined", build(true, false, true)),
        ("optimistic", build(false, true, true)),
    ]
}

/// `sql_mode`: on MySQL/MariaDB, added to the server's for every statement (one connection),
/// where the UPDATE goes with its values written into the text (see `inline.rs`).
async fn hostile(db: Option<TestDb>, sql_mode: &str) {
    let Some(test) = db else { return };
    let db = &if sql_mode.is_empty() {
        test.db.clone()
    } else if test.db.get_database_backend() == DbBackend::Postgres {
        // `sql_mode` names a setting for every connection (`standard_conforming_strings=off`):
        // backslashes in ordinary string literals become escapes.
        let mut options = sea_orm::ConnectOptions::new(&test.url);
        options.max_connections(1).sqlx_logging(false);
        if let Some(schema) = &test.schema {
            options.set_schema_search_path(schema);
        }
        #[cfg(feature = "postgres")]
        {
            let (name, value) = sql_mode.split_once('=').expect("name=value");
            let (name, value) = (name.to_owned(), value.to_owned());
            options.map_sqlx_postgres_opts(move |o| o.options([(name.as_str(), value.as_str())]));
        }
        sea_orm::Database::connect(options).await.expect("connect")
    } else {
        use sea_orm::ConnectionTrait;
        let db = servers::connect(&test.url, None, 1).await;
        let set = format!("SET SESSION sql_mode = CONCAT(@@sql_mode, '{sql_mode}')");
        db.execute_unprepared(&set).await.expect("sql_mode");
        db
    };
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
            assert_eq!(report.conflicts, 0, "{path} {value:?}: the guard held");
            let stored = report.outcome.model().expect("written").clone();
            assert_eq!(after.title, value, "{path}");
            assert_eq!(
                after.summary.as_deref(),
                Some(format!("{value}|{value}").as_str())
            );
            assert_eq!(*stored, after, "{path}: the report holds the row as stored");
            let bumped = i64::from(path != "unversioned");
            assert_eq!(after.changed, before.changed + bumped, "{path}: one write");
        }
    }
    let count = node::Entity::find().all(db).await.expect("rows").len();
    assert_eq!(count, 1, "no statement ran that was not ours");
}

servers::server_tests! {
    hostile_sqlite: hostile, "", sqlite;
    hostile_postgres: hostile, "", postgres;
    hostile_postgres_no_standard_strings: hostile, "standard_conforming_strings=off", postgres;
    hostile_mysql: hostile, "", mysql;
    hostile_mysql_no_backslash_escapes: hostile, ",NO_BACKSLASH_ESCAPES,ANSI_QUOTES", mysql;
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

    use freshlock::lock::backend::LeaseLock;
    use freshlock::lock::{LockName, MySqlNamedLock};
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

/// A row of every type `inline.rs` writes into a MySQL/MariaDB message's text, and of one it
/// does not (a decimal).
#[cfg(feature = "mysql")]
mod measure {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "inline_measure")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i32,
        pub ratio: f64,
        pub small: f32,
        pub flag: bool,
        pub big: i64,
        pub wide: u32,
        pub bytes: Vec<u8>,
        pub stamp: DateTime,
        pub day: Date,
        pub price: Decimal,
        pub note: Option<String>,
        pub n: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// Every type written into the text of the marker-and-UPDATE message (`inline.rs`) is stored
/// as a bound value would be, and compares equal in the guard of the next write (no version
/// column: the guard checks each column written against what was read — an `f32` against a
/// `FLOAT` column included, and dates with and without microseconds); a write holding a value
/// that is not written in (a decimal) is sent
/// bound, one statement at a time. Under the server's `sql_mode` and under
/// `NO_BACKSLASH_ESCAPES` and `ANSI_QUOTES`, and asked to write in two flights (`two_flights`),
/// which this entity's `FLOAT` column declines: it writes as before; every acknowledged write is
/// in the row once.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn every_written_in_type_is_stored_and_guarded_as_bound_mysql() {
    use freshlock::UpdateOutcome;
    use sea_orm::{ActiveModelTrait, ActiveValue::Set, ConnectionTrait, Statement};

    let Some(test) = servers::mysql("inline_types").await else {
        return;
    };
    test.db
        .execute_unprepared(
            "CREATE TABLE inline_measure (id INT PRIMARY KEY, ratio DOUBLE NOT NULL, \
             small FLOAT NOT NULL, flag BOOL NOT NULL, big BIGINT NOT NULL, \
             wide INT UNSIGNED NOT NULL, bytes VARBINARY(64) NOT NULL, \
             stamp DATETIME(6) NOT NULL, day DATE NOT NULL, price DECIMAL(10, 2) NOT NULL, \
             note VARCHAR(64) NULL, n INT NOT NULL)",
        )
        .await
        .expect("table");
    use sea_orm::prelude::{Date, DateTime, Decimal};
    fn day(d: u32) -> Date {
        Date::from_ymd_opt(2026, 12, d).expect("a day")
    }
    fn stamp(s: u32, micros: u32) -> DateTime {
        day(3).and_hms_micro_opt(7, 0, s, micros).expect("a time")
    }
    // Prepared statements run on the session's one connection (`Com_stmt_execute`).
    let executed = |db: sea_orm::DatabaseConnection| async move {
        let row = db
            .query_one_raw(Statement::from_string(
                DbBackend::MySql,
                "SHOW SESSION STATUS LIKE 'Com_stmt_execute'",
            ))
            .await
            .expect("status")
            .expect("a row");
        let value: String = row.try_get("", "Value").expect("value");
        value.parse::<i64>().expect("a count")
    };
    let modes = [
        (1, "", false),
        (2, ",NO_BACKSLASH_ESCAPES,ANSI_QUOTES", false),
        (3, "", true),
        (4, ",NO_BACKSLASH_ESCAPES,ANSI_QUOTES", true),
    ];
    for (id, mode, two_flights) in modes {
        let db = servers::connect(&test.url, None, 1).await;
        let set = format!("SET SESSION sql_mode = CONCAT(@@sql_mode, '{mode}')");
        db.execute_unprepared(&set).await.expect("sql_mode");
        measure::ActiveModel {
            id: Set(id),
            ratio: Set(0.5),
            small: Set(0.5),
            flag: Set(false),
            big: Set(0),
            wide: Set(0),
            bytes: Set(Vec::new()),
            stamp: Set(stamp(0, 123_456)),
            day: Set(day(3)),
            price: Set(Decimal::ZERO),
            note: Set(None),
            n: Set(0),
        }
        .insert(&db)
        .await
        .expect("seed");
        let session = Session::builder(db.clone())
            .lock(Arc::new(LocalLock::new()))
            .two_flights(two_flights)
            .build()
            .expect("session");
        let rows = session.repository::<measure::Entity>();
        type Change = fn(&mut measure::ActiveModel);
        let steps: [(&str, Change); 7] = [
            ("warm-up", |_| {}),
            ("written in", |m| {
                m.ratio = Set(0.1);
                m.small = Set(0.1);
                m.flag = Set(true);
                m.big = Set(i64::MIN);
                m.wide = Set(u32::MAX);
                m.bytes = Set(vec![0, b'\'', b'\\', b'"', 0xff]);
                m.note = Set(Some("O'Brien\\".to_owned()));
            }),
            ("written in", |m| {
                m.ratio = Set(1e308);
                m.small = Set(f32::MAX);
                m.flag = Set(false);
                m.big = Set(i64::MAX);
                m.bytes = Set(Vec::new());
                m.note = Set(None);
            }),
            ("written in", |m| {
                m.ratio = Set(-2.5e-300);
                m.small = Set(-1.0e-30);
                m.stamp = Set(stamp(1, 5));
                m.day = Set(day(4));
            }),
            ("written in", |m| {
                m.stamp = Set(stamp(2, 0));
            }),
            ("bound", |m| {
                m.price = Set(Decimal::new(1234, 2));
            }),
            ("written in", |m| {
                m.ratio = Set(0.3);
                m.small = Set(0.3);
                m.stamp = Set(stamp(3, 999_999));
            }),
        ];
        let mut acknowledged = 0;
        for (step, (how, change)) in steps.into_iter().enumerate() {
            let before = executed(db.clone()).await;
            let report = rows
                .locked_update(id, move |m| {
                    change(m);
                    let n = *m.n.as_ref();
                    m.n = Set(n + 1);
                    Ok(())
                })
                .await
                .unwrap_or_else(|e| panic!("{mode} step {step}: {e}"));
            assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
            acknowledged += 1;
            assert_eq!(report.conflicts, 0, "{mode} step {step}: the guard held");
            let prepared = executed(db.clone()).await - before - 1;
            // `SET TRANSACTION`, the reload and the read-back; the marker and the UPDATE besides
            // when bound. (A session's first write also makes a check of its own once: the
            // warm-up step is not counted.)
            // Not in two flights: a `FLOAT` column reads back with six digits in a text reply
            // (see `flights.rs`), so this entity writes as before.
            let expected = match how {
                "bound" => 5,
                "written in" => 3,
                _ => prepared,
            };
            assert_eq!(prepared, expected, "{mode} step {step}: {how}");
            let stored = measure::Entity::find_by_id(id)
                .one(&test.db)
                .await
                .expect("read")
                .expect("row");
            let reported = report.outcome.model().expect("written");
            assert_eq!(**reported, stored, "{mode} step {step}: as stored");
        }
        let stored = measure::Entity::find_by_id(id)
            .one(&test.db)
            .await
            .expect("read")
            .expect("row");
        assert_eq!(
            (
                stored.ratio,
                stored.small,
                stored.flag,
                stored.big,
                stored.wide
            ),
            (0.3, 0.3, false, i64::MAX, u32::MAX)
        );
        assert_eq!((stored.bytes.as_slice(), stored.note), (&[][..], None));
        assert_eq!((stored.stamp, stored.day), (stamp(3, 999_999), day(4)));
        assert_eq!(stored.price, Decimal::new(1234, 2));
        assert_eq!(
            stored.n, acknowledged,
            "{mode}: every acknowledged write, once"
        );
        assert_eq!(acknowledged, 7);
    }
}

/// Under `table` on MySQL/MariaDB a row write checks and frees its lease in the UPDATE's (the
/// DELETE's) own message, the lease's name written into the text (`inline.rs`): rows keyed by
/// the hostile values (their lock names hold them too) are each written in one attempt — the
/// closure (`before_delete`) runs once, so the check written in found the very lease the bound
/// grant took — and the commit frees the lease; under the server's `sql_mode` and under
/// `NO_BACKSLASH_ESCAPES` and `ANSI_QUOTES`. A write holding a value that is not written in (a
/// decimal) checks its lease by a bound statement of its own, also in one attempt. Every
/// acknowledged write is in its row once, every acknowledged delete gone.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn hostile_keys_check_their_lease_in_the_write_mysql() {
    use std::sync::atomic::{AtomicU32, Ordering};

    use freshlock::UpdateOutcome;
    use freshlock::lock::TableLock;
    use sea_orm::{
        ActiveModelTrait, ActiveValue::Set, ConnectionTrait, Statement, prelude::Decimal,
    };

    let Some(test) = servers::mysql("hostile_keys_table").await else {
        return;
    };
    test.db
        .execute_unprepared(
            "CREATE TABLE hostile_tag (name VARCHAR(64) CHARACTER SET utf8mb4 \
             COLLATE utf8mb4_bin PRIMARY KEY, price DECIMAL(10, 2) NOT NULL, n INT NOT NULL)",
        )
        .await
        .expect("table");
    let owned = || async {
        let row = test
            .db
            .query_one_raw(Statement::from_string(
                DbBackend::MySql,
                "SELECT COUNT(*) AS n FROM freshlock_lock WHERE owner IS NOT NULL",
            ))
            .await
            .expect("count")
            .expect("a row");
        row.try_get::<i64>("", "n").expect("n")
    };
    for mode in ["", ",NO_BACKSLASH_ESCAPES,ANSI_QUOTES"] {
        let db = servers::connect(&test.url, None, 1).await;
        let set = format!("SET SESSION sql_mode = CONCAT(@@sql_mode, '{mode}')");
        db.execute_unprepared(&set).await.expect("sql_mode");
        let session = Session::builder(db.clone())
            .lock(Arc::new(TableLock::new(db.clone())))
            .build()
            .expect("session");
        let tags = session.repository::<tag::Entity>();
        for value in HOSTILE {
            let key = format!("{value}{mode}");
            tag::ActiveModel {
                name: Set(key.clone()),
                price: Set(Decimal::ZERO),
                n: Set(0),
            }
            .insert(&test.db)
            .await
            .expect("seed");
            for (how, price) in [("written in", None), ("bound", Some(Decimal::new(1234, 2)))] {
                let applied = AtomicU32::new(0);
                let report = tags
                    .locked_update(key.clone(), |t| {
                        applied.fetch_add(1, Ordering::SeqCst);
                        if let Some(price) = price {
                            t.price = Set(price);
                        }
                        let n = *t.n.as_ref();
                        t.n = Set(n + 1);
                        Ok(())
                    })
                    .await
                    .unwrap_or_else(|e| panic!("{key:?} {how}: {e}"));
                assert!(
                    matches!(report.outcome, UpdateOutcome::Updated(_)),
                    "{key:?} {how}: {:?}",
                    report.outcome
                );
                assert!(report.lock.held && report.lock.release_error.is_none());
                assert_eq!(
                    applied.load(Ordering::SeqCst),
                    1,
                    "{key:?} {how}: one attempt, the lease found by the check"
                );
                assert_eq!(
                    owned().await,
                    0,
                    "{key:?} {how}: the commit freed the lease"
                );
            }
            let stored = tag::Entity::find_by_id(key.clone())
                .one(&test.db)
                .await
                .expect("read")
                .unwrap_or_else(|| panic!("{key:?}: the row"));
            assert_eq!(
                (stored.n, stored.price),
                (2, Decimal::new(1234, 2)),
                "{key:?}"
            );
            // The delete's check rides in its message the same way: one attempt (one
            // `before_delete`), the row gone, the lease freed.
            let before = tag::BEFORE_DELETE.load(Ordering::SeqCst);
            let report = tags.locked_delete(key.clone()).await.expect("delete");
            assert!(
                matches!(report.outcome, freshlock::DeleteOutcome::Deleted(_)),
                "{key:?}: {:?}",
                report.outcome
            );
            let attempts = tag::BEFORE_DELETE.load(Ordering::SeqCst) - before;
            assert_eq!(
                attempts, 1,
                "{key:?}: the delete's lease found by its check"
            );
            assert_eq!(
                owned().await,
                0,
                "{key:?}: the delete's commit freed the lease"
            );
            let gone = tag::Entity::find_by_id(key.clone()).one(&test.db).await;
            assert_eq!(gone.expect("read"), None, "{key:?}: deleted");
        }
    }
    let rows = tag::Entity::find().all(&test.db).await.expect("rows");
    assert!(
        rows.is_empty(),
        "no statement ran that was not ours: {rows:?}"
    );
}

/// A row keyed by text, with a value `inline.rs` does not write in (a decimal); counts its
/// `before_delete` calls (one per attempt of a delete).
#[cfg(feature = "mysql")]
mod tag {
    use std::sync::atomic::{AtomicU32, Ordering};

    use sea_orm::entity::prelude::*;

    pub static BEFORE_DELETE: AtomicU32 = AtomicU32::new(0);

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "hostile_tag")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub name: String,
        pub price: Decimal,
        pub n: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    #[async_trait::async_trait]
    impl ActiveModelBehavior for ActiveModel {
        async fn before_delete<C: ConnectionTrait>(self, _db: &C) -> Result<Self, DbErr> {
            BEFORE_DELETE.fetch_add(1, Ordering::SeqCst);
            Ok(self)
        }
    }
}
