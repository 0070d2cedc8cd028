//! Short, jittered waits between tries of a lock held in another process.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tokio::time::Instant;

/// Delays of 1–4 ms at first (a released lock is noticed fast, unlike Drupal's 25 ms → 500 ms),
/// doubling up to 50 ms, each with random jitter so that waiters do not retry in step.
#[derive(Debug)]
pub(crate) struct Backoff {
    ceiling: Duration,
    rng: u64,
}

const FIRST: Duration = Duration::from_millis(4);
const MAX: Duration = Duration::from_millis(50);

impl Backoff {
    pub(crate) fn new() -> Self {
        static SEQUENCE: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as u64);
        let seed = nanos
            ^ (SEQUENCE.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed))
            ^ u64::from(std::process::id()).rotate_left(32);
        Self {
            ceiling: FIRST,
            rng: seed | 1,
        }
    }

    /// The next delay: uniform in [ceiling/4, ceiling], then the ceiling doubles.
    pub(crate) fn next_delay(&mut self) -> Duration {
        // xorshift64*: plenty for jitter.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let random = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let ceiling = self.ceiling.as_micros() as u64;
        let floor = ceiling / 4;
        let delay = floor + random % (ceiling - floor + 1);
        self.ceiling = (self.ceiling * 2).min(MAX);
        Duration::from_micros(delay)
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
}
