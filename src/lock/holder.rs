//! Who holds a lock: host, process, task label, and a unique owner token.

use std::{
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{SystemTime, UNIX_EPOCH},
};

/// This process's host name (from `HOSTNAME` or `/etc/hostname`, else `"unknown"`).
pub(crate) fn host() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        std::env::var("HOSTNAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "unknown".to_owned())
    })
}

/// A token no other grant has ever had: host hash, pid, process start time and a sequence.
pub(crate) fn new_token() -> String {
    static START: OnceLock<u128> = OnceLock::new();
    static SEQUENCE: AtomicU64 = AtomicU64::new(0);
    let start = START.get_or_init(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    });
    let host = crate::LockName::trusted(host().to_owned()).stable_hash();
    format!(
        "{:08x}-{:x}-{:x}-{:x}",
        host as u32,
        std::process::id(),
        start,
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokens_are_unique_and_fit_the_owner_column() {
        let a = super::new_token();
        let b = super::new_token();
        assert_ne!(a, b);
        assert!(a.len() <= 64, "{a}");
    }
}
