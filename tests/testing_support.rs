//! The `testing` feature as a user meets it: a test written only with `freshlock::testing`,
//! against an entity and a `Migrator` of the user's own (declared here, not in `entity/` or
//! `migration/`).

#[path = "common/eventually.rs"]
mod eventually;

use std::{sync::Arc, time::Duration};

use freshlock::{
    Error, LockError, LockPolicy, OnLockFailure, UpdateOutcome,
    testing::{FakeLock, TestDatabase},
};
use sea_orm::{ConnectOptions, ConnectionTrait, Database, EntityTrait, Schema, Set};
use sea_orm_migration::prelude::*;

mod ticket {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "ticket")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i64,
        pub assignee: Option<String>,
        pub status: String,
        pub comments: i32,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// The user's migrations: their table only (freshlock's are added by `with_migrator`).
struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![Box::new(CreateTicket)]
    }
}

#[derive(DeriveMigrationName)]
struct CreateTicket;

#[async_trait::async_trait]
impl MigrationTrait for CreateTicket {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let schema = Schema::new(manager.get_database_backend());
        manager
            .create_table(schema.create_table_from_entity(ticket::Entity))
            .await
    }
}

async fn database(tickets: i64) -> TestDatabase {
    let db = TestDatabase::with_migrator::<Migrator>().await.unwrap();
    for id in 1..=tickets {
        ticket::Entity::insert(ticket::ActiveModel {
            id: Set(id),
            assignee: Set(None),
            status: Set("new".into()),
            comments: Set(0),
        })
        .exec(db.connection())
        .await
        .unwrap();
    }
    db.recorder().clear();
    db
}

async fn ticket_in_db(db: &TestDatabase, id: i64) -> ticket::Model {
    ticket::Entity::find_by_id(id)
        .one(db.connection())
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn the_users_migrator_and_freshlocks_tables_are_applied_and_statements_counted() {
    let db = database(1).await;
    let tickets = db.session().repository::<ticket::Entity>();
    let report = tickets
        .locked_update(1, |t| {
            t.status = Set("open".into());
            Ok(())
        })
        .await
        .unwrap();
    assert!(report.outcome.is_updated());

    assert_eq!(db.recorder().statements().len(), 2, "statements() copies…");
    let sent = db.recorder().take();
    assert_eq!(db.recorder().count("SELECT"), 0, "take() started over");
    let verbs: Vec<&str> = sent
        .iter()
        .filter_map(|s| s.split_whitespace().next())
        .collect();
    assert_eq!(verbs, ["SELECT", "UPDATE"], "{sent:#?}");
    assert_eq!(sent.len(), 2, "{sent:#?}");
    assert!(sent[1].contains("\"status\"") && !sent[1].contains("\"assignee\" ="));

    // freshlock's own tables exist too: the table-lease backend works on this database.
    let leases = db
        .session_builder()
        .lock(Arc::new(freshlock::lock::TableLock::new(
            db.connection().clone(),
        )))
        .build()
        .unwrap();
    let report = leases
        .repository::<ticket::Entity>()
        .locked_update(1, |t| {
            t.comments = Set(1);
            Ok(())
        })
        .await
        .unwrap();
    assert!(report.lock.held && report.outcome.is_updated());
}

#[tokio::test]
async fn the_database_survives_its_pool_closing_every_connection() {
    // What sqlx does to a connection whose query future was dropped, and what idle timeouts do:
    // close it. A plain `sqlite::memory:` database goes with its last connection…
    let mut options = ConnectOptions::new("sqlite::memory:");
    options.max_connections(1).sqlx_logging(false);
    let plain = Database::connect(options).await.unwrap();
    plain
        .execute_unprepared("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        .await
        .unwrap();
    let only = plain.get_sqlite_connection_pool().acquire().await.unwrap();
    only.close().await.unwrap();
    let gone = plain.execute_unprepared("SELECT * FROM t").await;
    assert!(
        gone.is_err_and(|e| e.to_string().contains("no such table")),
        "the hazard this helper exists for"
    );

    // …a TestDatabase does not.
    let db = database(3).await;
    for _ in 0..3 {
        let only = db.get_sqlite_connection_pool().acquire().await.unwrap();
        only.close().await.unwrap();
        assert_eq!(ticket_in_db(&db, 3).await.status, "new");
    }
    // And it lives as long as any clone of its connection.
    let url = db.url().to_owned();
    let connection = db.connection().clone();
    drop(db);
    let only = connection
        .get_sqlite_connection_pool()
        .acquire()
        .await
        .unwrap();
    only.close().await.unwrap();
    assert!(
        ticket::Entity::find_by_id(2)
            .one(&connection)
            .await
            .unwrap()
            .is_some()
    );
    let other = Database::connect(url.as_str()).await.unwrap();
    assert!(
        ticket::Entity::find_by_id(1)
            .one(&other)
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_request_timeouts_lose_nothing_and_leave_no_trace() {
    let db = database(4).await;
    let session = db.session();
    let tickets = session.repository::<ticket::Entity>();
    // A small deterministic generator: the cancellation points move around the section.
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut committed = [0i32; 4];
    let mut cancelled = 0;
    for _ in 0..200 {
        let id = (next() % 4) as i64 + 1;
        let budget = Duration::from_micros(next() % 200);
        let call = tickets.locked_update(id, |t| {
            t.comments = Set(t.comments.as_ref() + 1);
            Ok(())
        });
        match tokio::time::timeout(budget, call).await {
            Ok(Ok(report)) => {
                assert!(report.outcome.is_updated());
                committed[(id - 1) as usize] += 1;
            }
            Ok(Err(e)) => panic!("{e}"),
            Err(_elapsed) => {
                cancelled += 1;
                // Cancelled: it may still commit in the background (see the README); wait
                // until it is done, then the database is the truth and the cache agrees.
                eventually::eventually(
                    "the cancelled call finishes",
                    Duration::from_secs(30),
                    || session.in_flight() == 0,
                )
                .await;
                let row = ticket_in_db(&db, id).await;
                committed[(id - 1) as usize] = row.comments;
            }
        }
        // The next call on the key gets the lock at once.
        let strict = db
            .session_builder()
            .policy(
                LockPolicy::default()
                    .with_lock_tries(1)
                    .with_wait_per_try(Duration::ZERO)
                    .with_on_failure(OnLockFailure::Fail),
            )
            .build()
            .unwrap();
        let free = strict
            .repository::<ticket::Entity>()
            .locked_update(id, |_| Ok(()))
            .await
            .unwrap();
        assert!(matches!(free.outcome, UpdateOutcome::Unchanged(_)));
    }
    eprintln!("cancelled {cancelled} of 200");
    assert!(
        db.lock().is_empty(),
        "no lock held or awaited is left behind"
    );
    assert!(
        cancelled > 0,
        "the budgets are short enough to cancel calls"
    );
    for id in 1..=4 {
        let row = ticket_in_db(&db, id).await;
        assert_eq!(row.comments, committed[(id - 1) as usize]);
        assert_eq!(
            *tickets.load(id).await.unwrap().unwrap(),
            row,
            "cache agrees"
        );
    }
}

// Not `start_paused`: with a paused clock, the pool's acquire timeout fires while sqlx's SQLite
// worker thread runs a statement. `slow` is checked with a lower bound only.
#[tokio::test]
async fn the_fake_lock_fails_after_n_grants_and_can_be_slow() {
    let db = database(1).await;
    let fake = FakeLock::new();
    let session = db
        .session_builder()
        .lock(Arc::new(fake.clone()))
        .policy(LockPolicy::default().with_on_failure(OnLockFailure::Fail))
        .build()
        .unwrap();
    let tickets = session.repository::<ticket::Entity>();
    let assign = |who: &'static str| {
        move |t: &mut ticket::ActiveModel| {
            t.assignee = Set(Some(who.into()));
            Ok(())
        }
    };

    fake.fail_after(2).slow(Duration::from_millis(20));
    let started = tokio::time::Instant::now();
    tickets.locked_update(1, assign("ann")).await.unwrap();
    tickets.locked_update(1, assign("bob")).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(40),
        "two slow grants"
    );
    let third = tickets.locked_update(1, assign("cid")).await;
    assert!(
        matches!(
            third,
            Err(Error::Lock {
                source: LockError::Backend { .. },
                ..
            })
        ),
        "{third:?}"
    );
    assert_eq!((fake.grants(), fake.releases()), (2, 2));
    assert_eq!(ticket_in_db(&db, 1).await.assignee.as_deref(), Some("bob"));

    fake.recover().slow(Duration::ZERO).never_acquire(true);
    let busy = tickets.locked_update(1, assign("dee")).await;
    assert!(
        matches!(busy, Err(Error::LockNotAcquired { tries: 6, .. })),
        "{busy:?}"
    );
    assert_eq!(
        fake.tries(),
        3 + 6,
        "three calls tried once, the busy one six times"
    );
    assert_eq!(ticket_in_db(&db, 1).await.assignee.as_deref(), Some("bob"));
}
