//! A `table` lease grant whose reply is lost: the server took the lease for a token nobody
//! holds. It is resolved like an in-doubt write, by its token: released in the background, so
//! the name is free again at once instead of after the lease's TTL (a 30 s stall was measured
//! after a crash-restart before this). A TCP proxy cuts the connection right after forwarding
//! the grant's first statement (the grant is then asked again at once, under a new token, on
//! another connection), or black-holes it (nothing more passes, both sockets stay open): the
//! grant then fails after its reply bound instead of waiting forever. PostgreSQL and MariaDB.

#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/servers.rs"]
mod servers;

use std::{sync::Arc, time::Duration};

use freshlock::LockBackend;
use freshlock::lock::{LockName, TableLock};
use proxy::{CutAfter, Proxy};
use servers::{TestDb, databases};

/// Far longer than the test may take: only a release frees the name before it runs out.
const TTL: Duration = Duration::from_secs(300);

async fn lost_grant_frees_the_name(db: Option<TestDb>, black_hole: bool) {
    let Some(db) = db else { return };
    let name = LockName::new("lost-grant").unwrap();
    let direct: Arc<dyn LockBackend> = Arc::new(TableLock::new(db.db.clone()));
    // The name's row exists and is free: MySQL's grant tries to take a free row first.
    let first = direct.acquire(&name, Duration::ZERO, TTL).await.unwrap();
    first.expect("a free name").release().await.unwrap();

    let proxy = Proxy::start(proxy::target(&db.url), CutAfter::Grant).await;
    proxy.black_hole(black_hole);
    let mut options = sea_orm::ConnectOptions::new(proxy.url(&db.url));
    // No statement cache: the grant's text crosses the proxy (a cached statement goes by name).
    options.max_connections(2).sqlx_logging(false);
    #[cfg(feature = "postgres")]
    options.map_sqlx_postgres_opts(|o| o.statement_cache_capacity(0));
    #[cfg(feature = "mysql")]
    options.map_sqlx_mysql_opts(|o| o.statement_cache_capacity(0));
    if let Some(schema) = &db.schema {
        options.set_schema_search_path(schema);
    }
    let proxied = sea_orm::Database::connect(options).await.unwrap();
    let lost: Arc<dyn LockBackend> = Arc::new(TableLock::new(proxied));
    proxy.cut_once();
    // A black-holed grant waits its reply bound (a third of the TTL, at most 10 s), no longer.
    let granted = tokio::time::timeout(
        Duration::from_secs(30),
        lost.acquire(&name, Duration::ZERO, TTL),
    )
    .await
    .expect("a grant whose reply never comes does not wait forever");
    assert_eq!(proxy.cuts(), 1, "the grant's connection was cut");
    if black_hole {
        // No reply in time: the database is slow or unreachable, the grant fails.
        assert!(
            granted.is_err(),
            "a reply that never came is an error: {granted:?}"
        );
    } else {
        // A connection that broke is tried again at once under a new token, on another
        // connection (a connection that died idle in the pool fails that way too): the name is
        // then held by the lost grant's token until its background release (`None`, with no
        // wait), or free again already.
        match granted {
            Ok(Some(guard)) => guard.release().await.unwrap(),
            Ok(None) => {}
            Err(e) => panic!("a broken connection is tried again, not an error: {e}"),
        }
    }

    // The server took the lease; its token is released in the background, so another holder
    // gets the name within its wait, not after the 300 s TTL.
    let again = direct
        .acquire(&name, Duration::from_secs(20), TTL)
        .await
        .unwrap();
    let again = again.expect("the name is free again after the lost grant was resolved");
    again.release().await.unwrap();
}

servers::server_tests! {
    lost_grant_postgres: lost_grant_frees_the_name, false, postgres;
    lost_grant_mysql: lost_grant_frees_the_name, false, mysql;
    black_holed_grant_postgres: lost_grant_frees_the_name, true, postgres;
    black_holed_grant_mysql: lost_grant_frees_the_name, true, mysql;
}
