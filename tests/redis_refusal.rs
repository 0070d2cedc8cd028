//! A Redis that refuses a client (it is at `maxclients`) is reported as a refusal with the
//! server's reason, at once — not as "did not answer within 2 s". Runs a private `redis-server`
//! on a port of its own (the shared one is never touched).
#![cfg(feature = "redis")]

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::{process::Command, time::Duration};

use freshlock::lock::RedisLock;

struct PrivateRedis {
    port: u16,
    pidfile: std::path::PathBuf,
}

impl PrivateRedis {
    fn start(extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let pidfile = std::env::temp_dir().join(format!("{}.pid", servers::unique("redis")));
        let status = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "yes"])
            .args(["--pidfile", pidfile.to_str().unwrap()])
            .args(extra)
            .status()
            .expect("redis-server runs");
        assert!(status.success());
        Self { port, pidfile }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(&self.pidfile) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
        let _ = std::fs::remove_file(&self.pidfile);
    }
}

/// The error and its causes, as one text.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_is_reported_as_a_refusal() {
    if servers::url(servers::REDIS).is_none() {
        return; // The Redis tier is not asked for in this run.
    }
    let redis = PrivateRedis::start(&["--maxclients", "1"]);
    let client = redis::Client::open(redis.url()).unwrap();
    // Wait (bounded) for the server to answer, and keep its one client slot.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut occupant = loop {
        match client.get_multiplexed_async_connection().await {
            Ok(connection) => break connection,
            Err(e) => {
                assert!(tokio::time::Instant::now() < deadline, "{e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let _: String = redis::cmd("PING").query_async(&mut occupant).await.unwrap();

    let db = common::memory_db().await;
    let started = tokio::time::Instant::now();
    let refused = RedisLock::connect(&redis.url(), db).await;
    let error = refused.expect_err("no client slot is free");
    let text = chain(&error);
    assert!(text.contains("max number of clients"), "{text}");
    assert!(!text.contains("did not answer"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "reported at once, not by timeout"
    );
}
