//! What the dashboard's charts draw: the counters of every Subscription (from the dispatcher)
//! and every function (from the gateway), sampled at a fixed interval and kept for a few
//! minutes, turned into rates per interval.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::Serialize;

use eddy_platform::function_metrics::{CallTotals, SECONDS};

/// Counters of one Subscription at one sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeliveryTotals {
    /// Events delivered.
    pub delivered: u64,
    /// Attempts that failed and will be retried.
    pub retried: u64,
    /// Events dead-lettered.
    pub dead_lettered: u64,
}

/// Every counter at one moment.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// By `namespace/name`.
    pub subscriptions: HashMap<String, DeliveryTotals>,
    /// The dispatcher did not answer in time: its counters are unknown at this sample (a gap in
    /// the charts), not gone.
    pub subscriptions_unknown: bool,
    /// By `namespace/name`.
    pub functions: HashMap<String, CallTotals>,
}

/// The last samples, oldest first, at most `kept`.
#[derive(Debug)]
pub struct History {
    samples: VecDeque<Sample>,
    kept: usize,
}

/// One Subscription's rates per second, one value per interval (`None` where it did not
/// exist yet).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryRates {
    /// Delivered per second.
    pub delivered: Vec<Option<f64>>,
    /// Retried attempts per second.
    pub retried: Vec<Option<f64>>,
    /// Dead-lettered per second.
    pub dead_lettered: Vec<Option<f64>>,
}

/// One function's rates per interval.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CallRates {
    /// Calls per second.
    pub calls: Vec<Option<f64>>,
    /// 5xx answers per second.
    pub errors: Vec<Option<f64>>,
    /// The 99th percentile of the interval's call durations, in milliseconds (the upper
    /// bound of its histogram bucket); `None` for an interval without calls.
    pub p99: Vec<Option<f64>>,
}

/// What `/dashboard/state` sends for the charts.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Charts {
    /// Seconds between samples.
    pub interval: f64,
    /// Intervals drawn.
    pub samples: usize,
    /// By `namespace/name`.
    pub subscriptions: BTreeMap<String, DeliveryRates>,
    /// By `namespace/name`.
    pub functions: BTreeMap<String, CallRates>,
}

impl History {
    /// Keeps the last `kept` samples.
    pub fn new(kept: usize) -> Self {
        Self {
            samples: VecDeque::with_capacity(kept),
            kept: kept.max(2),
        }
    }

    /// Adds a sample, dropping the oldest beyond the limit.
    pub fn push(&mut self, sample: Sample) {
        if self.samples.len() == self.kept {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }

    /// Rates between consecutive samples taken `interval_seconds` apart, for what exists in
    /// the latest sample. A counter that went down (a restarted dispatcher) counts from zero.
    pub fn charts(&self, interval_seconds: f64) -> Charts {
        let mut charts = Charts {
            interval: interval_seconds,
            samples: self.samples.len().saturating_sub(1),
            ..Charts::default()
        };
        let Some(latest) = self.samples.back() else {
            return charts;
        };
        let pairs = || self.samples.iter().zip(self.samples.iter().skip(1));
        // The Subscriptions of the latest sample the dispatcher answered: one slow answer leaves
        // a gap, not a chart gone.
        let known = self
            .samples
            .iter()
            .rev()
            .find(|sample| !sample.subscriptions_unknown)
            .unwrap_or(latest);
        let rate = |now: u64, before: u64| {
            let added = if now >= before { now - before } else { now };
            added as f64 / interval_seconds
        };
        for name in known.subscriptions.keys() {
            let mut rates = DeliveryRates::default();
            for (before, now) in pairs() {
                match (before.subscriptions.get(name), now.subscriptions.get(name)) {
                    (Some(before), Some(now)) => {
                        rates
                            .delivered
                            .push(Some(rate(now.delivered, before.delivered)));
                        rates.retried.push(Some(rate(now.retried, before.retried)));
                        rates
                            .dead_lettered
                            .push(Some(rate(now.dead_lettered, before.dead_lettered)));
                    }
                    _ => {
                        rates.delivered.push(None);
                        rates.retried.push(None);
                        rates.dead_lettered.push(None);
                    }
                }
            }
            charts.subscriptions.insert(name.clone(), rates);
        }
        for name in latest.functions.keys() {
            let mut rates = CallRates::default();
            for (before, now) in pairs() {
                match (before.functions.get(name), now.functions.get(name)) {
                    (Some(before), Some(now)) => {
                        rates.calls.push(Some(rate(now.calls, before.calls)));
                        rates.errors.push(Some(rate(now.errors, before.errors)));
                        rates.p99.push(p99_millis(before, now));
                    }
                    _ => {
                        rates.calls.push(None);
                        rates.errors.push(None);
                        rates.p99.push(None);
                    }
                }
            }
            charts.functions.insert(name.clone(), rates);
        }
        charts
    }
}

/// The 99th percentile of the calls between two samples, as the upper bound of the bucket it
/// falls in (the last bound for calls beyond every bound); `None` without calls.
fn p99_millis(before: &CallTotals, now: &CallTotals) -> Option<f64> {
    let added: Vec<u64> = now
        .buckets
        .iter()
        .zip(before.buckets.iter())
        .map(|(now, before)| now.saturating_sub(*before))
        .collect();
    let total: u64 = added.iter().sum();
    if total == 0 {
        return None;
    }
    // The smallest bucket holding at least 99% of the calls.
    let needed = (total * 99).div_ceil(100);
    let mut seen = 0;
    let index = added
        .iter()
        .position(|count| {
            seen += count;
            seen >= needed
        })
        .unwrap_or(SECONDS.len());
    let bound = SECONDS
        .get(index)
        .or(SECONDS.last())
        .copied()
        .unwrap_or_default();
    Some(bound * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calls(calls: u64, errors: u64, fast: u64, slow: u64) -> CallTotals {
        let mut buckets = [0; SECONDS.len() + 1];
        buckets[1] = fast; // ≤ 2.5 ms
        buckets[7] = slow; // ≤ 250 ms
        CallTotals {
            calls,
            errors,
            buckets,
        }
    }

    fn sample(delivered: u64, dead: u64, function: Option<CallTotals>) -> Sample {
        let mut sample = Sample::default();
        sample.subscriptions.insert(
            "shop/orders".to_owned(),
            DeliveryTotals {
                delivered,
                retried: 0,
                dead_lettered: dead,
            },
        );
        if let Some(totals) = function {
            sample.functions.insert("shop/reserve".to_owned(), totals);
        }
        sample
    }

    #[test]
    fn rates_per_interval_and_p99_from_bucket_deltas() {
        let mut history = History::new(3);
        history.push(sample(0, 0, None)); // dropped: only three are kept
        history.push(sample(10, 0, None));
        history.push(sample(30, 2, Some(calls(100, 1, 99, 1))));
        history.push(sample(50, 2, Some(calls(300, 1, 299, 1))));
        let charts = history.charts(2.0);
        assert_eq!(charts.samples, 2);
        let orders = &charts.subscriptions["shop/orders"];
        assert_eq!(orders.delivered, [Some(10.0), Some(10.0)]);
        assert_eq!(orders.dead_lettered, [Some(1.0), Some(0.0)]);
        let reserve = &charts.functions["shop/reserve"];
        // Not there in the first interval.
        assert_eq!(reserve.calls, [None, Some(100.0)]);
        assert_eq!(reserve.errors, [None, Some(0.0)]);
        // 200 calls, all fast: p99 is the fast bucket's bound.
        assert_eq!(reserve.p99, [None, Some(2.5)]);
    }

    #[test]
    fn p99_lands_in_the_slow_bucket_when_over_one_percent_are_slow() {
        let before = calls(0, 0, 0, 0);
        assert_eq!(p99_millis(&before, &calls(100, 0, 98, 2)), Some(250.0));
        assert_eq!(p99_millis(&before, &calls(100, 0, 99, 1)), Some(2.5));
        assert_eq!(p99_millis(&before, &before), None);
    }

    #[test]
    fn a_sample_the_dispatcher_did_not_answer_is_a_gap_not_a_chart_gone() {
        let mut history = History::new(4);
        history.push(sample(0, 0, None));
        history.push(sample(20, 0, None));
        history.push(Sample {
            subscriptions_unknown: true,
            ..Sample::default()
        });
        let charts = history.charts(2.0);
        assert_eq!(
            charts.subscriptions["shop/orders"].delivered,
            vec![Some(10.0), None]
        );
    }

    #[test]
    fn a_counter_that_went_down_counts_from_zero() {
        let mut history = History::new(4);
        history.push(sample(500, 0, None));
        history.push(sample(6, 0, None));
        assert_eq!(
            history.charts(2.0).subscriptions["shop/orders"].delivered,
            [Some(3.0)]
        );
    }
}
