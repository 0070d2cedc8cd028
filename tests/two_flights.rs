//! `locked_update` in two round trips (`SessionBuilder::two_flights`): `BEGIN` and the reload as
//! one message, the guarded UPDATE and `COMMIT` as another, with the values
//! written into the text. Round trips are counted by a proxy between the pool and the server
//! (a client's messages sent without waiting for a reply in between are one), so a flight added
//! to the path fails here. Every acknowledged write is counted against the rows.
//!
//! The faults (lost `COMMIT` replies, cut reloads, killed backends) are `commit_faults.rs`'s
//! storms with two flights; hostile strings are `hostile_values.rs`'s.
//!
//! PostgreSQL (the shared server, a schema of the test's own), and MariaDB for the round trips
//! (its faults, types and hostile strings are in the same suites as PostgreSQL's).
#![cfg(feature = "postgres")]

mod common;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/servers.rs"]
mod servers;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use entity::node;
use freshlock::lock::{LocalLock, PgAdvisoryLock, RowLock};
use freshlock::{Error, LockBackend, LockPolicy, Session, UpdateOutcome};
use proxy::{CutAfter, Proxy};
use sea_orm::{ConnectionTrait, DatabaseConnection, EntityTrait, Set};
use servers::{TestDb, databases};

/// Calls measured after the warm-up (the incarnation token, the first prepared statements).
const CALLS: u32 = 30;

/// A pool of one connection through `proxy`, without the checkout ping (every message the proxy
/// sees is a call's), with `change` made to its options.
async fn proxied(
    db: &TestDb,
    proxy: &Proxy,
    change: impl FnOnce(&mut sea_orm::ConnectOptions),
) -> DatabaseConnection {
    proxy::one_connection(proxy, &db.url, db.schema.as_deref(), change).await
}

fn session(pool: &DatabaseConnection, two_flights: bool, versioned: bool) -> Session {
    session_with(pool, Arc::new(LocalLock::new()), two_flights, versioned)
}

fn session_with(
    pool: &DatabaseConnection,
    lock: Arc<dyn LockBackend>,
    two_flights: bool,
    versioned: bool,
) -> Session {
    let mut builder = Session::builder(pool.clone())
        .lock(lock)
        .policy(LockPolicy::default().with_wait_per_try(Duration::from_secs(30)))
        .two_flights(two_flights);
    if versioned {
        builder = builder.version_column::<node::Entity>(node::Column::Changed);
    }
    builder.build().expect("session")
}

async fn increment(session: &Session, id: i32) -> freshlock::UpdateReport<node::Model> {
    session
        .repository::<node::Entity>()
        .locked_update(id, |n| {
            n.score = Set(Some(n.score.as_ref().unwrap_or(0) + 1));
            Ok(())
        })
        .await
        .expect("locked_update")
}

/// Round trips per uncontended increment: two in two flights (versioned or not), four without;
/// a write that finds no row, or changes nothing, is two as well (the reload, then `COMMIT`).
/// After the warm-up no call reads which statements its connection prepared (PostgreSQL). The
/// row holds every acknowledged increment once.
///
/// `without`: the round trips of the same call without two flights — four on PostgreSQL; six on
/// MariaDB (`SET TRANSACTION`, `BEGIN`, the reload, the marker and the UPDATE as one message,
/// the read back, `COMMIT`).
async fn two_round_trips(db: Option<TestDb>, without: u32) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy, |_| {}).await;
    let mut acknowledged = 0;
    for (two_flights, versioned, per_call) in
        [(true, false, 2), (true, true, 2), (false, true, without)]
    {
        let session = session(&pool, two_flights, versioned);
        for _ in 0..3 {
            increment(&session, 1).await;
            acknowledged += 1;
        }
        let (before, listed) = (proxy.round_trips(), proxy.names_listed());
        for _ in 0..CALLS {
            let report = increment(&session, 1).await;
            assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
            assert_eq!((report.attempts, report.conflicts), (1, 0));
            acknowledged += 1;
        }
        let sent = proxy.round_trips() - before;
        assert_eq!(
            sent,
            CALLS * per_call,
            "two_flights {two_flights}, versioned {versioned}: round trips of {CALLS} calls"
        );
        // Which statements the connection prepared is known after the warm-up: not read again
        // (`db/prepared/`).
        assert_eq!(
            proxy.names_listed(),
            listed,
            "prepared statements read again"
        );
        if two_flights {
            let nodes = session.repository::<node::Entity>();
            let before = proxy.round_trips();
            let missing = nodes.locked_update(99, |_| Ok(())).await.expect("no row");
            assert!(matches!(missing.outcome, UpdateOutcome::NotFound));
            let kept = nodes.locked_update(1, |_| Ok(())).await.expect("kept");
            assert!(matches!(kept.outcome, UpdateOutcome::Unchanged(_)));
            assert_eq!(proxy.round_trips() - before, 4, "two each");
        }
    }
    assert_eq!(db.score(1).await, Some(acknowledged));
}

servers::server_tests! {
    two_round_trips_postgres: two_round_trips, 4, postgres;
    two_round_trips_mysql: two_round_trips, 6, mysql;
}

/// Under `pg_advisory` and `row` the reload tries the lock (as the engine's first statement
/// does): two round trips per call too. When the try fails — the lock is held elsewhere — nothing
/// was read or locked, and the write goes on as before, its lock taken by a statement of its own
/// (it waits for the holder), and is written once.
#[tokio::test]
async fn pg_advisory_and_row_try_their_lock_in_the_reload() {
    let Some(db) = servers::postgres("two_flights_locks").await else {
        return;
    };
    db.seed_nodes(1).await;
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy, |_| {}).await;
    let mut acknowledged = 0;
    let locks: [(&str, Arc<dyn LockBackend>); 2] = [
        ("pg_advisory", Arc::new(PgAdvisoryLock::new())),
        ("row", Arc::new(RowLock::new(pool.clone()))),
    ];
    for (name, lock) in locks {
        let session = session_with(&pool, Arc::clone(&lock), true, false);
        for _ in 0..3 {
            increment(&session, 1).await;
            acknowledged += 1;
        }
        let before = proxy.round_trips();
        for _ in 0..CALLS {
            let report = increment(&session, 1).await;
            assert!(report.lock.held, "{name}: the lock was had");
            assert_eq!((report.attempts, report.conflicts), (1, 0));
            acknowledged += 1;
        }
        assert_eq!(
            proxy.round_trips() - before,
            CALLS * 2,
            "{name}: round trips"
        );
    }
    assert_eq!(db.score(1).await, Some(acknowledged));

    // The advisory lock held by another session: the reload's try fails, the write waits for it
    // with a statement of its own, and goes through once it is free.
    let holder = servers::connect(&db.url, db.schema.as_deref(), 1).await;
    let key = freshlock::lock::PgAdvisoryLock::key(
        &freshlock::lock_name::<node::Entity>(1).expect("name"),
    );
    holder
        .execute_unprepared(&format!("SELECT pg_advisory_lock({key})"))
        .await
        .expect("hold");
    let session = session_with(&pool, Arc::new(PgAdvisoryLock::new()), true, false);
    let waiting = tokio::spawn(async move { increment(&session, 1).await });
    db.until(
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
        "the write waits for the advisory lock",
    )
    .await;
    holder
        .execute_unprepared(&format!("SELECT pg_advisory_unlock({key})"))
        .await
        .expect("free");
    let report = waiting.await.expect("task");
    assert!(report.outcome.is_updated() && report.lock.held);
    assert_eq!(db.score(1).await, Some(acknowledged + 1));
}

/// Every value type written into the text, then compared by the guard of the next write (no
/// version column: the guard checks each written column against what was read).
mod measure {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "measure")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i32,
        pub ratio: f64,
        pub small: f32,
        pub flag: bool,
        pub big: i64,
        pub little: i16,
        pub bytes: Vec<u8>,
        pub stamp: DateTime,
        pub stamptz: DateTimeUtc,
        pub day: Date,
        pub at: Time,
        #[sea_orm(column_type = "Decimal(Some((10, 2)))")]
        pub price: Decimal,
        pub note: Option<String>,
        pub n: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// Each value type is stored as its bound form would be and compares equal in the next write's
/// guard, with `standard_conforming_strings` on and off; each write written in is two round
/// trips, one holding a decimal (not written in) sends its UPDATE alone, bound. Every
/// acknowledged write is in the row once.
#[tokio::test]
async fn every_written_in_type_is_stored_and_guarded_as_bound() {
    use sea_orm::ActiveModelTrait;
    use sea_orm::prelude::{Date, DateTime, Decimal, Time};

    let Some(db) = servers::postgres("two_flights_types").await else {
        return;
    };
    db.db
        .execute_unprepared(
            "CREATE TABLE measure (id integer PRIMARY KEY, ratio double precision NOT NULL, \
             small real NOT NULL, flag boolean NOT NULL, big bigint NOT NULL, \
             little smallint NOT NULL, bytes bytea NOT NULL, stamp timestamp NOT NULL, \
             stamptz timestamptz NOT NULL, day date NOT NULL, at time NOT NULL, \
             price numeric(10, 2) NOT NULL, note text NULL, n integer NOT NULL)",
        )
        .await
        .expect("table");
    fn day(d: u32) -> Date {
        Date::from_ymd_opt(2026, 12, d).expect("a day")
    }
    fn stamp(s: u32, micros: u32) -> DateTime {
        day(3).and_hms_micro_opt(7, 0, s, micros).expect("a time")
    }
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    for (id, conforming) in [(1, "on"), (2, "off")] {
        let conforming: &'static str = conforming;
        let pool = proxied(&db, &proxy, |options| {
            options.map_sqlx_postgres_opts(move |o| {
                o.options([("standard_conforming_strings", conforming)])
            });
        })
        .await;
        let setting = pool
            .query_one_raw(sea_orm::Statement::from_string(
                sea_orm::DbBackend::Postgres,
                "SHOW standard_conforming_strings",
            ))
            .await
            .expect("show")
            .expect("a row");
        let setting: String = setting
            .try_get("", "standard_conforming_strings")
            .expect("setting");
        assert_eq!(setting, conforming);
        measure::ActiveModel {
            id: Set(id),
            ratio: Set(0.5),
            small: Set(0.5),
            flag: Set(false),
            big: Set(0),
            little: Set(0),
            bytes: Set(Vec::new()),
            stamp: Set(stamp(0, 123_456)),
            stamptz: Set(stamp(0, 1).and_utc()),
            day: Set(day(3)),
            at: Set(Time::from_hms_micro_opt(1, 2, 3, 4).expect("t")),
            price: Set(Decimal::ZERO),
            note: Set(None),
            n: Set(0),
        }
        .insert(&db.db)
        .await
        .expect("seed");
        let session = Session::builder(pool.clone())
            .lock(Arc::new(LocalLock::new()))
            .two_flights(true)
            .build()
            .expect("session");
        let rows = session.repository::<measure::Entity>();
        type Change = fn(&mut measure::ActiveModel);
        // Three warm-ups: the incarnation token seen, then the reload that no longer reads it
        // prepared by name on the connection (one round trip more, once).
        let steps: [(&str, Change); 9] = [
            ("warm-up", |_| {}),
            ("warm-up", |_| {}),
            ("warm-up", |_| {}),
            ("written in", |m| {
                m.ratio = Set(0.1);
                m.small = Set(0.1);
                m.flag = Set(true);
                m.big = Set(i64::MIN);
                m.little = Set(-7);
                m.bytes = Set(vec![0, b'\'', b'\\', b'"', b'$', 0xff]);
                m.note = Set(Some("O'Brien\\ \\x41 $1 E'\\'' ; COMMIT; --".to_owned()));
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
                m.stamptz = Set(stamp(1, 999_999).and_utc());
                m.day = Set(day(4));
                m.at = Set(Time::from_hms_opt(23, 59, 59).expect("t"));
            }),
            ("written in", |m| {
                m.stamp = Set(stamp(2, 0));
                m.note = Set(Some("unicode ✓ 日本\n\t".to_owned()));
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
            let before = proxy.round_trips();
            let report = rows
                .locked_update(id, move |m| {
                    change(m);
                    let n = *m.n.as_ref();
                    m.n = Set(n + 1);
                    Ok(())
                })
                .await
                .unwrap_or_else(|e| panic!("{conforming} step {step}: {e}"));
            assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
            acknowledged += 1;
            assert_eq!(
                report.conflicts, 0,
                "{conforming} step {step}: the guard held"
            );
            let sent = proxy.round_trips() - before;
            let expected = match how {
                // The reload, the UPDATE prepared (sqlx describes a new statement first, one
                // round trip) and executed, `COMMIT`.
                "bound" => 4,
                "written in" => 2,
                _ => sent,
            };
            assert_eq!(sent, expected, "{conforming} step {step}: {how}");
            let stored = measure::Entity::find_by_id(id)
                .one(&db.db)
                .await
                .expect("read")
                .expect("row");
            let reported = report.outcome.model().expect("written");
            assert_eq!(**reported, stored, "{conforming} step {step}: as stored");
        }
        let stored = measure::Entity::find_by_id(id)
            .one(&db.db)
            .await
            .expect("read")
            .expect("row");
        assert_eq!(
            (stored.ratio, stored.small, stored.flag, stored.big),
            (0.3, 0.3, false, i64::MAX)
        );
        assert_eq!(stored.little, -7);
        assert_eq!(stored.bytes, Vec::<u8>::new());
        assert_eq!(
            stored.note.as_deref(),
            Some("unicode ✓ 日本\n\t"),
            "{conforming}"
        );
        assert_eq!((stored.stamp, stored.day), (stamp(3, 999_999), day(4)));
        assert_eq!(stored.stamptz, stamp(1, 999_999).and_utc());
        assert_eq!(stored.price, Decimal::new(1234, 2));
        assert_eq!(stored.n, acknowledged, "{conforming}: every write, once");
        assert_eq!(acknowledged, 9);
    }
}

/// Hooks on the two-flight path: a `before_save` that writes an audit row in the transaction,
/// an `after_save` that fails when told to.
mod audited {
    use sea_orm::{Statement, entity::prelude::*};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "audited")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i32,
        pub n: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    #[async_trait::async_trait]
    impl ActiveModelBehavior for ActiveModel {
        async fn before_save<C: ConnectionTrait>(
            self,
            db: &C,
            _insert: bool,
        ) -> Result<Self, DbErr> {
            if super::AUDIT.load(std::sync::atomic::Ordering::SeqCst) {
                let id = *self.id.as_ref();
                db.execute_raw(Statement::from_sql_and_values(
                    db.get_database_backend(),
                    "INSERT INTO audit_log (audited) VALUES ($1)",
                    [id.into()],
                ))
                .await?;
            }
            Ok(self)
        }

        async fn after_save<C: ConnectionTrait>(
            model: Model,
            _db: &C,
            _insert: bool,
        ) -> Result<Model, DbErr> {
            super::AFTER_SAVES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if super::FAIL_AFTER.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(DbErr::Custom("after_save refused".into()));
            }
            Ok(model)
        }
    }
}

static AUDIT: AtomicBool = AtomicBool::new(false);
static FAIL_AFTER: AtomicBool = AtomicBool::new(false);
static AFTER_SAVES: AtomicU32 = AtomicU32::new(0);

/// A `before_save` that writes sends the UPDATE alone and commits after `after_save` (its audit
/// row commits with the write); one that does not commits in the UPDATE's message and runs
/// `after_save` after the commit, whose error is the call's while the write stands, once (it is
/// not run again). Every acknowledged write, and the failed `after_save`'s, is in the row once.
#[tokio::test]
async fn hooks_keep_their_writes_in_the_transaction() {
    let Some(db) = servers::postgres("two_flights_hooks").await else {
        return;
    };
    db.db
        .execute_unprepared(
            "CREATE TABLE audited (id integer PRIMARY KEY, n integer NOT NULL); \
             CREATE TABLE audit_log (audited integer NOT NULL); \
             INSERT INTO audited VALUES (1, 0)",
        )
        .await
        .expect("tables");
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy, |_| {}).await;
    let session = Session::builder(pool.clone())
        .lock(Arc::new(LocalLock::new()))
        .two_flights(true)
        .build()
        .expect("session");
    let rows = session.repository::<audited::Entity>();
    let bump = || {
        rows.locked_update(1, |a| {
            let n = *a.n.as_ref();
            a.n = Set(n + 1);
            Ok(())
        })
    };
    let audit_rows = || async {
        let row = db.query_one("SELECT count(*) AS n FROM audit_log").await;
        row.try_get::<i64>("", "n").expect("count")
    };
    // Warm-up: the incarnation token.
    bump().await.expect("warm-up");

    AUDIT.store(true, Ordering::SeqCst);
    for call in 0..4 {
        let before = proxy.round_trips();
        let report = bump().await.expect("audited");
        assert!(matches!(report.outcome, UpdateOutcome::Updated(_)));
        // The reload, the audit INSERT, the UPDATE alone, `COMMIT`: four once the two bound
        // statements are prepared (the first call prepares them, one round trip each, and the
        // first call whose reload no longer reads the incarnation token prepares that by name,
        // one round trip more); the UPDATE and `COMMIT` in one message would make three.
        if call > 1 {
            assert_eq!(proxy.round_trips() - before, 4, "the UPDATE went alone");
        }
    }
    assert_eq!(
        audit_rows().await,
        4,
        "each audit row committed with its write"
    );
    AUDIT.store(false, Ordering::SeqCst);

    FAIL_AFTER.store(true, Ordering::SeqCst);
    let after_saves = AFTER_SAVES.load(Ordering::SeqCst);
    let failed = bump().await;
    FAIL_AFTER.store(false, Ordering::SeqCst);
    match failed {
        Err(Error::Database { operation, .. }) => {
            assert!(operation.contains("after the commit"), "{operation}")
        }
        other => panic!("expected after_save's error, got {other:?}"),
    }
    assert_eq!(
        AFTER_SAVES.load(Ordering::SeqCst),
        after_saves + 1,
        "not run again"
    );
    let stored = audited::Entity::find_by_id(1)
        .one(&db.db)
        .await
        .expect("read")
        .expect("row");
    assert_eq!(
        stored.n, 6,
        "the warm-up, four audited, and the one whose after_save failed"
    );
    // The session does not serve a row it cannot vouch for: the next write reloads it.
    let report = bump().await.expect("after");
    assert_eq!(report.outcome.model().map(|m| m.n), Some(7));
}

/// Without `freshlock_incarnation` the commit's evidence is a marker, whose INSERT rides in the
/// UPDATE's statement (a CTE): still two round trips, and with every third `COMMIT`'s reply cut
/// (the server commits, the client never hears) each lost reply is resolved by its marker —
/// every call acknowledged once, the row holding exactly the acknowledged increments.
#[tokio::test]
async fn without_the_incarnation_table_a_marker_rides_in_the_update() {
    let Some(db) = servers::postgres("two_flights_marker").await else {
        return;
    };
    db.seed_nodes(1).await;
    db.db
        .execute_unprepared("DROP TABLE freshlock_incarnation")
        .await
        .expect("drop");
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let pool = proxied(&db, &proxy, |_| {}).await;
    let session = session(&pool, true, false);
    increment(&session, 1).await;
    let before = proxy.round_trips();
    for _ in 0..CALLS {
        increment(&session, 1).await;
    }
    assert_eq!(proxy.round_trips() - before, CALLS * 2, "round trips");
    let markers = db
        .query_one("SELECT count(*) AS n FROM freshlock_commit")
        .await
        .try_get::<i64>("", "n")
        .expect("count");
    assert!(markers > 0, "the writes left their markers (swept in time)");

    proxy.cut_every(3);
    for _ in 0..12 {
        increment(&session, 1).await;
    }
    assert!(proxy.cuts() >= 4, "the proxy cut commit replies");
    assert_eq!(db.score(1).await, Some(1 + CALLS as i32 + 12));
}

/// The value types of MySQL/MariaDB's text replies that read back exactly (no `FLOAT`: see
/// `flights.rs`), written in and compared by the next write's guard, under the server's
/// `sql_mode` and under `NO_BACKSLASH_ESCAPES` and `ANSI_QUOTES`.
#[cfg(feature = "mysql")]
mod sample {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "sample")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i32,
        pub ratio: f64,
        pub flag: bool,
        pub big: i64,
        pub wide: u32,
        pub bytes: Vec<u8>,
        pub stamp: DateTime,
        pub day: Date,
        #[sea_orm(column_type = "Decimal(Some((10, 2)))")]
        pub price: Decimal,
        pub note: Option<String>,
        pub n: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// Each value is stored as its bound form would be and compares equal in the next write's
/// guard; a write written in is two round trips, one holding a decimal (not written in) more.
/// Every acknowledged write is in the row once.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn every_written_in_type_is_stored_and_guarded_as_bound_mysql() {
    use sea_orm::ActiveModelTrait;
    use sea_orm::prelude::{Date, DateTime, Decimal};

    let Some(db) = databases::mysql("two_flights_types").await else {
        return;
    };
    db.db
        .execute_unprepared(
            "CREATE TABLE sample (id INT PRIMARY KEY, ratio DOUBLE NOT NULL, \
             flag BOOL NOT NULL, big BIGINT NOT NULL, wide INT UNSIGNED NOT NULL, \
             bytes VARBINARY(64) NOT NULL, stamp DATETIME(6) NOT NULL, day DATE NOT NULL, \
             price DECIMAL(10, 2) NOT NULL, note VARCHAR(64) NULL, n INT NOT NULL)",
        )
        .await
        .expect("table");
    fn day(d: u32) -> Date {
        Date::from_ymd_opt(2026, 12, d).expect("a day")
    }
    fn stamp(s: u32, micros: u32) -> DateTime {
        day(3).and_hms_micro_opt(7, 0, s, micros).expect("a time")
    }
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    for (id, mode) in [(1, ""), (2, ",NO_BACKSLASH_ESCAPES,ANSI_QUOTES")] {
        let pool = proxied(&db, &proxy, |_| {}).await;
        let set = format!("SET SESSION sql_mode = CONCAT(@@sql_mode, '{mode}')");
        pool.execute_unprepared(&set).await.expect("sql_mode");
        sample::ActiveModel {
            id: Set(id),
            ratio: Set(0.5),
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
        .insert(&db.db)
        .await
        .expect("seed");
        let session = Session::builder(pool.clone())
            .lock(Arc::new(LocalLock::new()))
            .two_flights(true)
            .build()
            .expect("session");
        let rows = session.repository::<sample::Entity>();
        type Change = fn(&mut sample::ActiveModel);
        let steps: [(&str, Change); 6] = [
            ("warm-up", |_| {}),
            ("written in", |m| {
                m.ratio = Set(0.1);
                m.flag = Set(true);
                m.big = Set(i64::MIN);
                m.wide = Set(u32::MAX);
                m.bytes = Set(vec![0, b'\'', b'\\', b'"', 0xff]);
                m.note = Set(Some("O'Brien\\ `x` \"y\" ; COMMIT; --".to_owned()));
            }),
            ("written in", |m| {
                m.ratio = Set(-2.5e-300);
                m.big = Set(i64::MAX);
                m.bytes = Set(Vec::new());
                m.note = Set(None);
                m.stamp = Set(stamp(1, 5));
                m.day = Set(day(4));
            }),
            ("written in", |m| {
                m.stamp = Set(stamp(2, 0));
                m.note = Set(Some("unicode ✓ 日本".to_owned()));
            }),
            ("bound", |m| {
                m.price = Set(Decimal::new(1234, 2));
            }),
            ("written in", |m| {
                m.ratio = Set(0.3);
                m.stamp = Set(stamp(3, 999_999));
            }),
        ];
        let mut acknowledged = 0;
        for (step, (how, change)) in steps.into_iter().enumerate() {
            let before = proxy.round_trips();
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
            let sent = proxy.round_trips() - before;
            match how {
                "written in" => assert_eq!(sent, 2, "{mode} step {step}: written in"),
                "bound" => assert!(sent > 2, "{mode} step {step}: bound, {sent}"),
                _ => {}
            }
            let stored = sample::Entity::find_by_id(id)
                .one(&db.db)
                .await
                .expect("read")
                .expect("row");
            let reported = report.outcome.model().expect("written");
            assert_eq!(**reported, stored, "{mode} step {step}: as stored");
        }
        let stored = sample::Entity::find_by_id(id)
            .one(&db.db)
            .await
            .expect("read")
            .expect("row");
        assert_eq!(
            (stored.ratio, stored.flag, stored.big, stored.wide),
            (0.3, true, i64::MAX, u32::MAX)
        );
        assert_eq!(stored.note.as_deref(), Some("unicode ✓ 日本"), "{mode}");
        assert_eq!((stored.stamp, stored.day), (stamp(3, 999_999), day(4)));
        assert_eq!(stored.price, Decimal::new(1234, 2));
        assert_eq!(stored.n, acknowledged, "{mode}: every write, once");
    }
}

/// A statement that fails in flight 2's message — the UPDATE, refused by a `CHECK` constraint —
/// stops the message: its `COMMIT` never runs, the call fails with the database's error (never
/// success), nothing is written, and the next write goes through on a new connection. On
/// PostgreSQL and MariaDB.
async fn a_failed_update_never_commits(db: Option<TestDb>, _: ()) {
    let Some(db) = db else { return };
    db.seed_nodes(1).await;
    db.db
        .execute_unprepared("ALTER TABLE node ADD CONSTRAINT score_small CHECK (score < 1000)")
        .await
        .expect("constraint");
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    // No minimum: the failed write's connection is closed, and a pool keeping one would open
    // its replacement (round trips of its own) while this test counts.
    let pool = proxied(&db, &proxy, |options| {
        options.min_connections(0);
    })
    .await;
    let session = session(&pool, true, false);
    let nodes = session.repository::<node::Entity>();
    // Warm-ups: the incarnation token seen, then the reload that no longer reads it prepared by
    // name on the connection.
    for _ in 0..3 {
        increment(&session, 1).await;
    }
    let before = proxy.round_trips();
    let refused = nodes
        .locked_update(1, |n| {
            n.score = Set(Some(5_000));
            Ok(())
        })
        .await;
    assert!(
        matches!(refused, Err(Error::Database { .. })),
        "the UPDATE's error, never success: {refused:?}"
    );
    assert_eq!(
        proxy.round_trips() - before,
        2,
        "one message each way, not run again"
    );
    assert_eq!(db.score(1).await, Some(3), "nothing written");
    let report = increment(&session, 1).await;
    assert!(report.outcome.is_updated());
    assert_eq!(db.score(1).await, Some(4));
}

servers::server_tests! {
    failed_update_postgres: a_failed_update_never_commits, (), postgres;
    failed_update_mysql: a_failed_update_never_commits, (), mysql;
}
