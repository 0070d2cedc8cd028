//! Short, jittered waits between tries of a lock held in another process (backon's exponential
//! backoff with jitter).

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use tokio::time::Instant;

/// Delays of 2–4 ms at first (a released lock is noticed fast, unlike Drupal's 25 ms → 500 ms),
/// doubling up to 25–50 ms, each with random jitter so that waiters do not retry in step.
#[derive(Debug)]
pub(crate) struct Backoff {
    delays: ExponentialBackoff,
}

/// The first delay's base (jitter adds up to as much again).
const FIRST: Duration = Duration::from_millis(2);
/// The longest delay, jitter included.
const MAX: Duration = Duration::from_millis(50);

impl Backoff {
    pub(crate) fn new() -> Self {
        Self {
            delays: ExponentialBuilder::default()
                .with_min_delay(FIRST)
                .with_max_delay(MAX / 2)
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .build(),
        }
    }

    /// The next delay: uniform in [base, 2 × base), then the base doubles (up to half of MAX).
    pub(crate) fn next_delay(&mut self) -> Duration {
        self.delays.next().unwrap_or(MAX)
    }

    /// Sleeps for the next delay, but not past `deadline`. Returns `false` when the deadline
    /// has passed (nothing left to wait for).
    pub(crate) async fn wait_until(&mut self, deadline: Instant) -> bool {
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        tokio::time::sleep(self.next_delay().min(deadline - now)).await;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_retry_is_within_5ms_and_delays_stay_bounded() {
        for _ in 0..100 {
            let mut backoff = Backoff::new();
            let first = backoff.next_delay();
            assert!(first >= Duration::from_millis(1) && first <= Duration::from_millis(5));
            for _ in 0..20 {
                assert!(backoff.next_delay() <= MAX);
            }
        }
    }

    #[test]
    fn waiters_do_not_retry_in_step() {
        let firsts: std::collections::HashSet<Duration> =
            (0..100).map(|_| Backoff::new().next_delay()).collect();
        assert!(
            firsts.len() > 10,
            "jittered: {} distinct first delays",
            firsts.len()
        );
    }
}
