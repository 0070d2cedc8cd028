//! A PostgreSQL cluster of a test's own (initdb as `postgres`, on a free port, its own data
//! directory; the shared server is never touched), and a streaming replica of it
//! (`pg_basebackup -R`). Both are stopped and removed on drop.
#![allow(dead_code)]

use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

pub const BIN: &str = "/usr/lib/postgresql/15/bin";

pub fn as_postgres(command: &str) -> bool {
    Command::new("su")
        .args(["postgres", "-c", command])
        .status()
        .is_ok_and(|status| status.success())
}

/// A PostgreSQL cluster of this test's own, stopped and removed on drop.
pub struct PrivatePostgres {
    pub dir: PathBuf,
    pub port: u16,
}

impl PrivatePostgres {
    pub fn start() -> Self {
        let (dir, port) = (owned_dir(), crate::servers::free_port());
        assert!(as_postgres(&format!(
            "{BIN}/initdb -D {} -U postgres --auth=trust >/dev/null",
            dir.display()
        )));
        let server = Self { dir, port };
        server.configure();
        assert!(
            server.pg_ctl("-l {d}/log -w start"),
            "the private server starts"
        );
        server
    }

    /// A streaming replica of this server (`pg_basebackup -R`: it follows the primary's WAL and
    /// serves reads), on a port and directory of its own.
    pub fn replica(&self) -> Self {
        let (dir, port) = (owned_dir(), crate::servers::free_port());
        assert!(
            as_postgres(&format!(
                "{BIN}/pg_basebackup -h 127.0.0.1 -p {} -U postgres -D {} -R >/dev/null",
                self.port,
                dir.display()
            )),
            "pg_basebackup from the private primary"
        );
        let replica = Self { dir, port };
        replica.configure();
        assert!(replica.pg_ctl("-l {d}/log -w start"), "the replica starts");
        replica
    }

    /// Port, socket directory and `fsync = off` (these tests crash servers, not disks); later
    /// lines win, so a copied primary's settings are overridden.
    fn configure(&self) {
        let d = self.dir.display();
        let conf = format!(
            "\nport = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{d}'\n\
             fsync = off\n",
            self.port
        );
        let path = self.dir.join("postgresql.conf");
        std::fs::write(&path, std::fs::read_to_string(&path).unwrap() + &conf).unwrap();
    }

    pub fn pg_ctl(&self, args: &str) -> bool {
        let d = self.dir.display().to_string();
        as_postgres(&format!(
            "{BIN}/pg_ctl -D {d} {} >/dev/null",
            args.replace("{d}", &d)
        ))
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn kill_postmaster(&self) {
        let pid = std::fs::read_to_string(self.dir.join("postmaster.pid")).unwrap();
        let pid = pid.lines().next().unwrap().trim().to_owned();
        assert!(
            Command::new("kill")
                .args(["-9", &pid])
                .status()
                .unwrap()
                .success()
        );
    }

    /// Starts the server again after a kill (its orphaned backends may take a moment to go).
    pub fn start_again(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.pg_ctl("-l {d}/log -w start") {
            assert!(
                Instant::now() < deadline,
                "the private server did not start again"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn accepting(&self) -> bool {
        Command::new("pg_isready")
            .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            .status()
            .is_ok_and(|status| status.success())
    }
}

/// A new empty directory owned by `postgres` (initdb and pg_basebackup refuse to run as root).
fn owned_dir() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(crate::servers::unique("pgdata"));
    std::fs::create_dir_all(&dir).unwrap();
    // PostgreSQL starts only on a data directory no one else may read (pg_basebackup keeps the
    // mode it finds).
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    assert!(
        Command::new("chown")
            .args(["postgres:postgres", dir.to_str().unwrap()])
            .status()
            .unwrap()
            .success()
    );
    dir
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self.pg_ctl("-m immediate stop");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
