//! A MariaDB server of a test's own (`mariadb-install-db` into its own data directory, on a free
//! port; the shared server is never touched), crashed or restarted at will, killed and removed
//! on drop.
#![allow(dead_code)]

use std::{
    path::PathBuf,
    process::Command,
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::servers;

/// A MariaDB server of this test's own, killed and removed on drop.
pub struct PrivateMariaDb {
    pub dir: PathBuf,
    pub port: u16,
    child: Mutex<Option<std::process::Child>>,
}

impl PrivateMariaDb {
    pub fn start() -> Self {
        let port = servers::free_port();
        let dir = std::env::temp_dir().join(servers::unique("mariadb"));
        let data = dir.join("data");
        std::fs::create_dir_all(&data).unwrap();
        // A temporary directory of its own, for the install and the server: with the system's
        // /tmp, a MariaDB starting elsewhere removes the `#sql-temptable-*` files of an install
        // running at the same time ("Installation of system tables failed", seen in CI).
        let tmp = private_tmpdir(&dir);
        // Once more if the first try fails (seen once with 16 installs at a time); its output
        // is in the message if the second fails too.
        let install = || {
            let _ = std::fs::remove_dir_all(&data);
            std::fs::create_dir_all(&data).unwrap();
            Command::new("mariadb-install-db")
                .args([
                    "--user=mysql",
                    &format!("--datadir={}", data.display()),
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                    &format!("--tmpdir={}", tmp.display()),
                ])
                .output()
                .unwrap()
        };
        let mut installed = install();
        if !installed.status.success() {
            installed = install();
        }
        assert!(
            installed.status.success(),
            "mariadb-install-db: {}{}",
            String::from_utf8_lossy(&installed.stdout),
            String::from_utf8_lossy(&installed.stderr)
        );
        let d = dir.display();
        std::fs::write(
            dir.join("my.cnf"),
            format!(
                "[mysqld]\nport = {port}\nsocket = {d}/sock\npid-file = {d}/pid\n\
                 datadir = {d}/data\nbind-address = 127.0.0.1\nuser = mysql\n\
                 innodb_flush_log_at_trx_commit = 2\nlog-error = {d}/log\ntmpdir = {d}/tmp\n"
            ),
        )
        .unwrap();
        assert!(
            Command::new("chown")
                .args(["-R", "mysql:mysql", &d.to_string()])
                .status()
                .unwrap()
                .success()
        );
        let server = Self {
            dir,
            port,
            child: Mutex::new(None),
        };
        server.launch();
        let created = Command::new("mariadb")
            .args(["-h", "127.0.0.1", "-P", &port.to_string(), "-uroot", "-e"])
            .arg("CREATE DATABASE test CHARACTER SET utf8mb4")
            .status()
            .unwrap();
        assert!(created.success());
        server
    }

    /// Starts `mariadbd` and waits (bounded) until it answers.
    pub fn launch(&self) {
        let child = Command::new("mariadbd")
            .arg(format!("--defaults-file={}/my.cnf", self.dir.display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        *self.child.lock().unwrap() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.accepting() {
            assert!(
                Instant::now() < deadline,
                "the private MariaDB did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }

    pub fn accepting(&self) -> bool {
        Command::new("mariadb-admin")
            .args([
                "-h",
                "127.0.0.1",
                "-P",
                &self.port.to_string(),
                "-uroot",
                "ping",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    }

    /// `kill -9` of `mariadbd` (a crash: InnoDB recovers on start), then starts it again and
    /// waits until it answers.
    pub fn kill9_and_restart(&self) {
        let mut child = self.child.lock().unwrap().take().expect("running");
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        self.launch();
    }

    /// A clean shutdown (`mariadb-admin shutdown`), then a start.
    pub fn restart(&self) {
        let mut child = self.child.lock().unwrap().take().expect("running");
        let _ = Command::new("mariadb-admin")
            .args(["-h", "127.0.0.1", "-P", &self.port.to_string(), "-uroot"])
            .arg("shutdown")
            .status();
        child.wait().unwrap();
        self.launch();
    }
}

impl Drop for PrivateMariaDb {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `dir/tmp`, writable by the server's user: a MariaDB's temporary directory of its own.
pub fn private_tmpdir(dir: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    tmp
}
