//! A lease whose release failed because the database was unreachable is released in the
//! background as soon as the database answers again: its key is free long before its TTL.
//! PostgreSQL and MariaDB, through a proxy that plays the outage (the shared servers keep
//! running).

mod common;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/servers.rs"]
mod servers;

use std::time::Duration;

use freshlock::LockKind;
use freshlock::lock::backend::LeaseLock;
use freshlock::lock::{LockName, TableLock};
use proxy::{CutAfter, Proxy};
use servers::{TestDb, databases};

async fn released_when_the_database_returns(db: Option<TestDb>, _: LockKind) {
    let Some(db) = db else { return };
    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Commit).await;
    let mut options = sea_orm::ConnectOptions::new(proxy.url(&db.url));
    options
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(1))
        .sqlx_logging(false);
    if let Some(schema) = &db.schema {
        options.set_schema_search_path(schema);
    }
    let proxied = sea_orm::Database::connect(options).await.unwrap();
    let name = LockName::new("lease:1").unwrap();
    let ttl = Duration::from_secs(60);
    let held = TableLock::new(proxied)
        .acquire(&name, Duration::ZERO, ttl)
        .await
        .unwrap()
        .expect("a free lease");

    proxy.set_down(true);
    let failed = held.release().await;
    assert!(
        failed.is_err(),
        "the database is unreachable: the release fails"
    );
    let direct = TableLock::new(db.db.clone());
    assert!(
        direct
            .acquire(&name, Duration::ZERO, ttl)
            .await
            .unwrap()
            .is_none(),
        "still held while the database cannot be told"
    );

    proxy.set_down(false);
    // Well within the 60 s TTL: the background release gets through once the database answers.
    let taken = direct
        .acquire(&name, Duration::from_secs(2), ttl)
        .await
        .unwrap()
        .expect("the lease was released after the outage, long before its TTL");
    taken.release().await.unwrap();
}

servers::server_tests! {
    table_postgres: released_when_the_database_returns, LockKind::Table, postgres;
    table_mysql: released_when_the_database_returns, LockKind::Table, mysql;
}
