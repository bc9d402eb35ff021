//! Delays between retries: one type for every retry loop in eddy (event delivery, NATS
//! reconnects, watches, start-up, instance restarts, Kubernetes reconciles).

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How delays grow from one failure to the next (a Subscription's `delivery.backoff`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum BackoffShape {
    /// initialDelay × 2^(attempt-1), capped at maxDelay.
    #[default]
    Exponential,
    /// initialDelay × attempt, capped at maxDelay.
    Linear,
    /// initialDelay every time.
    Constant,
}

/// Retry delays: `initial` after the first failure, growing by `shape`, never above `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// How the delay grows.
    pub shape: BackoffShape,
    /// The delay after the first failure.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
}

impl Backoff {
    /// Doubling from `initial` up to `max`.
    pub const fn exponential(initial: Duration, max: Duration) -> Self {
        Self {
            shape: BackoffShape::Exponential,
            initial,
            max,
        }
    }

    /// Growing by `step` per failure up to `max`.
    pub const fn linear(step: Duration, max: Duration) -> Self {
        Self {
            shape: BackoffShape::Linear,
            initial: step,
            max,
        }
    }

    /// The delay before trying again after `failures` failures in a row: none after none.
    pub fn delay(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let delay = match self.shape {
            BackoffShape::Constant => self.initial,
            BackoffShape::Linear => self.initial.saturating_mul(failures),
            BackoffShape::Exponential => self
                .initial
                .saturating_mul(2u32.saturating_pow((failures - 1).min(31))),
        };
        delay.min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn exponential_doubles_up_to_the_cap() {
        let backoff = Backoff::exponential(100 * MS, 1000 * MS);
        let delays: Vec<_> = (0..=6).map(|f| backoff.delay(f)).collect();
        assert_eq!(
            delays,
            [0, 100, 200, 400, 800, 1000, 1000].map(|ms| ms * MS)
        );
        assert_eq!(backoff.delay(u32::MAX), 1000 * MS);
    }

    #[test]
    fn linear_grows_by_its_step_up_to_the_cap() {
        let backoff = Backoff::linear(50 * MS, 120 * MS);
        let delays: Vec<_> = (0..=4).map(|f| backoff.delay(f)).collect();
        assert_eq!(delays, [0, 50, 100, 120, 120].map(|ms| ms * MS));
        assert_eq!(backoff.delay(u32::MAX), 120 * MS);
    }

    #[test]
    fn constant_stays_put_and_respects_the_cap() {
        let backoff = Backoff {
            shape: BackoffShape::Constant,
            initial: 300 * MS,
            max: 200 * MS,
        };
        assert_eq!(backoff.delay(0), Duration::ZERO);
        assert_eq!(backoff.delay(1), 200 * MS);
        assert_eq!(backoff.delay(50), 200 * MS);
    }

    #[test]
    fn huge_delays_saturate_instead_of_overflowing() {
        let backoff = Backoff::exponential(Duration::from_secs(u64::MAX / 4), Duration::MAX);
        assert_eq!(backoff.delay(40), Duration::MAX);
    }
}
