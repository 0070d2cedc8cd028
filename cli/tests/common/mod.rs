//! Databases for the command's tests: a fresh database per test on the servers named by the
//! environment (skipped without a URL, failed with `FRESHLOCK_REQUIRE_SERVERS=1`).
#![allow(dead_code)]

use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection};

pub async fn connect(url: &str) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url);
    options.max_connections(2).sqlx_logging(false);
    Database::connect(options).await.expect("connect")
}

// The library's test helpers: one `unique` and one URL rule (skip, or fail under
// `FRESHLOCK_REQUIRE_SERVERS`) for the whole workspace.
#[path = "../../../tests/common/servers.rs"]
mod servers;
pub use servers::{unique, url as server_url};

/// A fresh database on a server, dropped with [`Fresh::drop_database`].
pub struct Fresh {
    pub admin: DatabaseConnection,
    pub name: String,
    pub url: String,
}

/// A fresh database on the PostgreSQL (`postgres`) or MariaDB (`mysql`) server of the
/// environment, or `None` to skip.
pub async fn fresh_database(server: &str, tag: &str) -> Option<Fresh> {
    let (var, enabled) = match server {
        "postgres" => ("DATABASE_URL_POSTGRES", cfg!(feature = "postgres")),
        _ => ("DATABASE_URL_MYSQL", cfg!(feature = "mysql")),
    };
    let base = server_url(var)?;
    assert!(enabled, "{var} is set: run with --features {server}");
    let admin = connect(&base).await;
    let name = unique(tag);
    let create = match server {
        "postgres" => format!("CREATE DATABASE \"{name}\""),
        _ => format!("CREATE DATABASE `{name}` CHARACTER SET utf8mb4"),
    };
    admin.execute_unprepared(&create).await.unwrap();
    let root = base
        .rsplit_once('/')
        .map_or(base.as_str(), |(root, _)| root);
    let url = format!("{root}/{name}");
    Some(Fresh { admin, name, url })
}

impl Fresh {
    pub async fn drop_database(self) {
        let drop = match self.admin.get_database_backend() {
            sea_orm::DbBackend::Postgres => format!("DROP DATABASE \"{}\" WITH (FORCE)", self.name),
            _ => format!("DROP DATABASE `{}`", self.name),
        };
        self.admin.execute_unprepared(&drop).await.unwrap();
    }
}
