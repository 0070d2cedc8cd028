//! The [`Migrator`] for freshlock's example domain (see the `entity` crate).
//!
//! Apply it with `cargo run -p migration -- up` (the sea-orm-migration CLI; `DATABASE_URL` names
//! the database), or from code with `Migrator::up(&db, None)`.

pub use sea_orm_migration::prelude::*;

mod m20261130_000001_create_node;
mod m20261130_000002_create_ham_spam;
mod m20261130_000003_create_account_stock_order;

/// Every migration of the example domain, oldest first.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        let mut migrations: Vec<Box<dyn MigrationTrait>> = vec![
            Box::new(m20261130_000001_create_node::Migration),
            Box::new(m20261130_000002_create_ham_spam::Migration),
            Box::new(m20261130_000003_create_account_stock_order::Migration),
        ];
        // freshlock's own tables (leases, lock rows, claims): the library ships the migrations.
        migrations.extend(freshlock::schema::migrations());
        migrations
    }
}
