//! The sea-orm-migration command line for the example domain (`cargo run -p migration -- up`).

use sea_orm_migration::prelude::*;

#[tokio::main]
async fn main() {
    cli::run_cli(migration::Migrator).await;
}
