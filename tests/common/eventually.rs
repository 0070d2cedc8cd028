//! One wait helper for every test: a condition polled with a deadline, never a hang.
#![allow(dead_code)]

/// Waits until `condition` holds, yielding to other tasks between checks; fails (naming `what`)
/// after `within` of real time instead of hanging.
pub async fn eventually(
    what: &str,
    within: std::time::Duration,
    mut condition: impl FnMut() -> bool,
) {
    let deadline = std::time::Instant::now() + within;
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::task::yield_now().await;
    }
}
