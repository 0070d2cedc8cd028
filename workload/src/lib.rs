//! The two field reports' workloads, written once and driven by three drivers: `freshlock demo`
//! (prints them), the tests (assert on them) and the benchmarks (time them).
//!
//! - [`drupal`]: four queue workers each load a node, do heavy work, set their own field and
//!   save — the naive way, the report's failed fix, a lock around everything, and freshlock.
//! - [`django`]: Spam tasks that must be serialized per Ham, claimed and finished — the report's
//!   parent-row lock, and freshlock's claims with the Ham's key.
//! - [`percentile`]: the one latency summary all three report with.

use std::time::Duration;

pub mod django;
pub mod drupal;

/// What a workload step fails with (a driver reports it or panics on it).
pub type Failure = Box<dyn std::error::Error + Send + Sync>;

/// The `p`th percentile (0–100, nearest rank below) of `samples`, sorting them; zero when
/// there are none.
pub fn percentile(samples: &mut [Duration], p: usize) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    samples[(samples.len() * p / 100).min(samples.len() - 1)]
}

/// [`percentile`] in milliseconds, to two decimals (for tables and JSON).
pub fn percentile_ms(samples: &mut [Duration], p: usize) -> f64 {
    (percentile(samples, p).as_secs_f64() * 1e5).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_and_empty_is_zero() {
        let mut samples: Vec<_> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(percentile(&mut samples, 50), Duration::from_millis(51));
        assert_eq!(percentile(&mut samples, 99), Duration::from_millis(100));
        assert_eq!(percentile(&mut samples, 100), Duration::from_millis(100));
        assert_eq!(percentile(&mut samples, 0), Duration::from_millis(1));
        assert_eq!(percentile(&mut [], 50), Duration::ZERO);
        assert_eq!(percentile_ms(&mut [Duration::from_micros(1234)], 50), 1.23);
    }
}
