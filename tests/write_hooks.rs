//! sea-orm's `ActiveModelBehavior` hooks run on every write path, what they set is written (and
//! guarded) like any other column, and every returned and cached row is the row as the database
//! stored it: a `timestamptz` / `numeric(12,2)` on PostgreSQL, `DATETIME` / `DECIMAL(12,2)` on
//! MariaDB, and SQLite.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::{
    collections::HashMap,
    sync::{LazyLock, Mutex},
};

use freshlock::{DeleteOutcome, SaveOutcome, Session, UpdateOutcome};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, EntityTrait, IntoActiveModel, Schema, Set,
    prelude::Decimal,
};
use servers::{TestDb, databases};

/// A user's entity whose `before_save` stamps `updated_at` (with nanoseconds, which no database
/// here stores) and counts saves in the row; every hook call is also counted per product id.
mod product {
    use sea_orm::{ActiveValue, Set, entity::prelude::*};

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "product")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub id: i32,
        pub name: String,
        #[sea_orm(column_type = "Decimal(Some((12, 2)))")]
        pub price: Decimal,
        pub saves: i32,
        pub updated_at: DateTimeUtc,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    #[async_trait::async_trait]
    impl ActiveModelBehavior for ActiveModel {
        async fn before_save<C: ConnectionTrait>(
            mut self,
            _db: &C,
            insert: bool,
        ) -> Result<Self, DbErr> {
            let id = *self.id.as_ref();
            super::count(
                id,
                if insert {
                    "before_insert"
                } else {
                    "before_update"
                },
            );
            let saves = match &self.saves {
                ActiveValue::Set(n) | ActiveValue::Unchanged(n) => *n,
                ActiveValue::NotSet => 0,
            };
            self.saves = Set(saves + 1);
            // Nanoseconds, which PostgreSQL (µs), MariaDB DATETIME (s) do not keep.
            let now = DateTimeUtc::from(std::time::SystemTime::now());
            self.updated_at = Set(now);
            Ok(self)
        }

        async fn after_save<C: ConnectionTrait>(
            model: Model,
            _db: &C,
            _insert: bool,
        ) -> Result<Model, DbErr> {
            super::count(model.id, "after_save");
            Ok(model)
        }

        async fn before_delete<C: ConnectionTrait>(self, _db: &C) -> Result<Self, DbErr> {
            super::count(*self.id.as_ref(), "before_delete");
            Ok(self)
        }

        async fn after_delete<C: ConnectionTrait>(self, _db: &C) -> Result<Self, DbErr> {
            super::count(*self.id.as_ref(), "after_delete");
            Ok(self)
        }
    }
}

static CALLS: LazyLock<Mutex<HashMap<(i32, &'static str), u32>>> = LazyLock::new(Mutex::default);

fn count(id: i32, hook: &'static str) {
    *CALLS.lock().unwrap().entry((id, hook)).or_default() += 1;
}

fn calls(id: i32, hook: &'static str) -> u32 {
    CALLS.lock().unwrap().get(&(id, hook)).copied().unwrap_or(0)
}

async fn create_products(db: &DatabaseConnection) {
    let ddl = match db.get_database_backend() {
        DbBackend::Postgres => Some(
            "CREATE TABLE product (id integer PRIMARY KEY, name text NOT NULL, \
             price numeric(12,2) NOT NULL, saves integer NOT NULL, \
             updated_at timestamptz NOT NULL)",
        ),
        DbBackend::MySql => Some(
            "CREATE TABLE product (id integer PRIMARY KEY, name varchar(64) NOT NULL, \
             price DECIMAL(12,2) NOT NULL, saves integer NOT NULL, \
             updated_at DATETIME NOT NULL)",
        ),
        _ => None,
    };
    match ddl {
        Some(ddl) => db.execute_unprepared(ddl).await.map(drop),
        None => db
            .execute(&Schema::new(DbBackend::Sqlite).create_table_from_entity(product::Entity))
            .await
            .map(drop),
    }
    .expect("create product");
}

async fn stored(db: &DatabaseConnection, id: i32) -> Option<product::Model> {
    product::Entity::find_by_id(id).one(db).await.unwrap()
}

/// Every write path, with hooks: each returns and caches the stored row; `before_save` stamps
/// and counts; a no-op update runs no hook; delete runs the delete hooks. `base` keeps the ids of
/// concurrent tests apart (the hook counters are per id).
async fn hooks_and_stored_rows(db: DatabaseConnection, base: i32) {
    create_products(&db).await;
    let session = Session::new(db.clone());
    let products = session.repository::<product::Entity>();
    let id = base + 1;

    // insert: `updated_at` is NOT NULL and set only by the hook.
    let inserted = products
        .insert(product::ActiveModel {
            id: Set(id),
            name: Set("lamp".into()),
            price: Set(Decimal::new(11_305, 3)), // 11.305: the column keeps 2 decimals
            saves: Set(0),
            ..Default::default()
        })
        .await
        .expect("the hook sets updated_at");
    let row = stored(&db, id).await.unwrap();
    assert_eq!(*inserted, row, "insert returns the row as stored");
    assert_eq!(row.saves, 1);
    if db.get_database_backend() != DbBackend::Sqlite {
        assert_eq!(row.price, Decimal::new(1131, 2), "rounded by the database");
    }
    assert_eq!(calls(id, "before_insert"), 1);

    // save: one more stamp, the hook's columns written; the outcome and the cache are the
    // stored row (no nanoseconds the database dropped, no digits it rounded).
    let mut change = (*inserted).clone().into_active_model();
    change.price = Set(Decimal::new(12_345, 3));
    let SaveOutcome::Updated(saved) = products.save(change).await.unwrap() else {
        panic!("expected an update");
    };
    let row = stored(&db, id).await.unwrap();
    assert_eq!(*saved, row);
    assert_eq!(
        *products.load(id).await.unwrap().unwrap(),
        row,
        "cached as stored"
    );
    assert_eq!(row.saves, 2);
    assert_eq!(calls(id, "before_update"), 1);

    // save of what the row already holds: Unchanged, no hook, nothing written (the hook would
    // stamp `updated_at`, a change that is not one).
    let mut same = row.clone().into_active_model();
    same.price = Set(row.price);
    assert!(matches!(
        products.save(same).await.unwrap(),
        SaveOutcome::Unchanged
    ));
    assert_eq!(calls(id, "before_update"), 1, "no hook ran");
    assert_eq!(stored(&db, id).await.unwrap(), row, "nothing written");

    // The hook's columns are guarded like the caller's: `updated_at` is a whole-row version. A
    // save from a snapshot older than another session's hooked save conflicts, even though the
    // two changed different columns; the newer write stays.
    let older = Session::new(db.clone());
    let stale = older
        .repository::<product::Entity>()
        .load(id)
        .await
        .unwrap()
        .unwrap();
    let mut renamed = row.clone().into_active_model();
    renamed.name = Set("lamp, renamed".into());
    assert!(matches!(
        products.save(renamed).await.unwrap(),
        SaveOutcome::Updated(_)
    ));
    let mut repriced = (*stale).clone().into_active_model();
    repriced.price = Set(Decimal::new(99, 0));
    assert!(matches!(
        older
            .repository::<product::Entity>()
            .save(repriced)
            .await
            .unwrap(),
        SaveOutcome::Conflict
    ));
    let row = stored(&db, id).await.unwrap();
    assert_eq!((row.name.as_str(), row.saves), ("lamp, renamed", 3));
    assert_eq!(
        calls(id, "before_update"),
        3,
        "the refused save's hook ran, nothing written"
    );

    // locked_update: hooks run in the transaction.
    let report = products
        .locked_update(id, |p| {
            p.name = Set("desk lamp".into());
            Ok(())
        })
        .await
        .unwrap();
    let UpdateOutcome::Updated(updated) = report.outcome else {
        panic!("expected an update");
    };
    let row = stored(&db, id).await.unwrap();
    assert_eq!(*updated, row);
    assert_eq!(*products.load(id).await.unwrap().unwrap(), row);
    assert_eq!((row.saves, row.name.as_str()), (4, "desk lamp"));
    assert_eq!(calls(id, "before_update"), 4);
    assert_eq!(calls(id, "after_save"), 4);

    // Nothing changed → no UPDATE, and no hook (it would stamp a change that is not one).
    let report = products.locked_update(id, |_| Ok(())).await.unwrap();
    assert!(matches!(report.outcome, UpdateOutcome::Unchanged(_)));
    assert_eq!(calls(id, "before_update"), 4);
    assert_eq!(stored(&db, id).await.unwrap().saves, 4);

    // get_or_insert / update_or_insert create through the hooks too.
    let got = products
        .get_or_insert(id + 1, || product::ActiveModel {
            name: Set("chair".into()),
            price: Set(Decimal::new(5, 0)),
            saves: Set(0),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(got.is_created());
    let created = got.into_model();
    assert_eq!(*created, stored(&db, id + 1).await.unwrap());
    assert_eq!(created.saves, 1);

    // locked_delete: the delete hooks, the row as it was, the cache forgets it.
    let report = products.locked_delete(id).await.unwrap();
    let DeleteOutcome::Deleted(gone) = report.outcome else {
        panic!("expected a delete");
    };
    assert_eq!(*gone, row);
    assert!(stored(&db, id).await.is_none());
    assert!(products.load(id).await.unwrap().is_none());
    assert_eq!(
        (calls(id, "before_delete"), calls(id, "after_delete")),
        (1, 1)
    );
    assert!(matches!(
        products.locked_delete(id).await.unwrap().outcome,
        DeleteOutcome::NotFound
    ));
    assert_eq!(calls(id, "before_delete"), 1);
}

#[tokio::test]
async fn hooks_and_stored_rows_in_memory() {
    hooks_and_stored_rows(common::memory_db().await, 0).await;
}

async fn hooks_on(db: Option<TestDb>, base: i32) {
    if let Some(db) = db {
        hooks_and_stored_rows(db.db, base).await;
    }
}

servers::server_tests! {
    hooks_sqlite_file: hooks_on, 100, sqlite;
    hooks_postgres: hooks_on, 200, postgres;
    hooks_mysql: hooks_on, 300, mysql;
}
