//! An entity declared only here, not in `entity/`: users add their own types with no boilerplate.

use freshlock::UpdateOutcome;
use freshlock::testing::TestDatabase;
use sea_orm::{ConnectionTrait, Schema, Set};

/// A user's own entity with a composite, non-integer primary key.
mod inventory {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
    #[sea_orm(table_name = "inventory")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub warehouse: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub sku: i64,
        pub on_hand: i32,
        pub note: Option<String>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

#[tokio::test]
async fn a_plain_user_entity_works_with_load_reset_cache_and_locked_update() {
    let db = TestDatabase::new().await.unwrap();
    let schema = Schema::new(db.get_database_backend());
    db.execute(&schema.create_table_from_entity(inventory::Entity))
        .await
        .unwrap();
    let session = db.session();
    let stock = session.repository::<inventory::Entity>();
    stock
        .insert(inventory::ActiveModel {
            warehouse: Set("tokyo".into()),
            sku: Set(7),
            on_hand: Set(10),
            note: Set(None),
        })
        .await
        .unwrap();

    let key = ("tokyo".to_string(), 7i64);
    let loaded = stock.load(key.clone()).await.unwrap().unwrap();
    assert_eq!(loaded.on_hand, 10);
    assert_eq!(stock.reset_cache([key.clone()]).unwrap(), 1);

    let report = stock
        .locked_update(key.clone(), |row| {
            let on_hand = row.on_hand.as_ref() - 3;
            row.on_hand = Set(on_hand);
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!(report.lock.name.as_str(), "inventory:'tokyo',7");
    let UpdateOutcome::Updated(row) = report.outcome else {
        panic!("expected an update");
    };
    assert_eq!(row.on_hand, 7);
    assert_eq!(stock.load(key).await.unwrap().unwrap().on_hand, 7);
    assert!(
        stock
            .load(("osaka".to_string(), 7))
            .await
            .unwrap()
            .is_none()
    );
}
