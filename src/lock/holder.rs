//! Who holds a lock: host, process, task label, and a unique owner token.

use std::{
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{SystemTime, UNIX_EPOCH},
};

/// This process's host name (the system's, else `"unknown"`).
pub(crate) fn host() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        let host = gethostname::gethostname()
            .to_string_lossy()
            .trim()
            .to_owned();
        if host.is_empty() {
            "unknown".to_owned()
        } else {
            host
        }
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
    let host = super::name::LockName::trusted(host().to_owned()).stable_hash();
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
