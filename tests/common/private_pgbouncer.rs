//! A private PgBouncer (transaction mode) in front of the shared PostgreSQL, started by
//! `.ci/pgbouncer` on a free port with a directory of its own, stopped when dropped.
#![allow(dead_code)]

use std::process::Command;

pub struct PrivatePgBouncer {
    pub port: u16,
    dir: String,
}

impl PrivatePgBouncer {
    /// Starts one; `reset_always: false` leaves out `server_reset_query_always` (a pooler that
    /// keeps prepared statements between transactions). `None` (after saying why) where
    /// PgBouncer is not installed, unless `FRESHLOCK_REQUIRE_SERVERS` is set.
    pub fn start(reset_always: bool) -> Option<Self> {
        let installed = std::path::Path::new("/usr/sbin/pgbouncer").exists()
            || Command::new("sh")
                .args(["-c", "command -v pgbouncer"])
                .status()
                .is_ok_and(|s| s.success());
        if !installed && std::env::var_os("FRESHLOCK_REQUIRE_SERVERS").is_none() {
            eprintln!("SKIPPED: pgbouncer is not installed (apt-get install -y pgbouncer)");
            return None;
        }
        // A port another test took between our check and PgBouncer's bind fails the start:
        // tried again on another port.
        for _ in 0..3 {
            let port = super::servers::free_port();
            let dir = format!("/tmp/fl_pgbouncer_{}_{port}", std::process::id());
            let status = Command::new("bash")
                .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/pgbouncer"))
                .env("PGBOUNCER_PORT", port.to_string())
                .env("PGBOUNCER_DIR", &dir)
                .env(
                    "PGBOUNCER_RESET_ALWAYS",
                    if reset_always { "1" } else { "0" },
                )
                .status()
                .expect("run .ci/pgbouncer");
            let started = Self { port, dir };
            if status.success() {
                return Some(started);
            }
            eprintln!("PgBouncer did not start on port {port}: trying another");
            drop(started); // stops whatever did start, removes its directory
        }
        panic!("PgBouncer did not start on three ports")
    }

    /// Its URL for database `name`.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }
}

impl Drop for PrivatePgBouncer {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/pgbouncer"))
            .arg("stop")
            .env("PGBOUNCER_PORT", self.port.to_string())
            .env("PGBOUNCER_DIR", &self.dir)
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
