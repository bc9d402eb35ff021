//! The autoscaler's decisions: how many instances the load calls for, from the requests in
//! flight and waiting over the scale-down window. Pure but for reading the pool's counters.

use super::{Duration, Inner, Instant, Ordering, Pool, VecDeque};

/// Inputs of the autoscaler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScaleInput {
    /// `minReplicas`.
    pub min: usize,
    /// `maxReplicas`.
    pub max: usize,
    /// In-flight requests per instance to aim for.
    pub target: usize,
    /// Highest in-flight count (including requests waiting for an instance) over the window.
    pub peak_load: usize,
    /// Requests waiting for an instance now.
    pub waiting: usize,
    /// Time since the last request.
    pub idle_for: Duration,
    /// Idle time before scaling to zero.
    pub scale_to_zero_after: Duration,
}

/// How many instances to run. Pure.
pub fn desired_replicas(input: ScaleInput) -> usize {
    let target = input.target.max(1);
    let by_load = input.peak_load.div_ceil(target);
    let mut desired = by_load.max(input.min).min(input.max.max(input.min));
    let active =
        input.waiting > 0 || input.peak_load > 0 || input.idle_for < input.scale_to_zero_after;
    // `replicas: 0` (max 0) switches a function off; otherwise activity keeps one instance.
    if desired == 0 && active && input.max > 0 {
        desired = 1;
    }
    desired
}

/// The load samples of the last scale-down window: scaling down follows the peak over the
/// window, so a short lull does not stop instances that the next burst needs. Pure: the time is
/// given.
#[derive(Debug, Default)]
pub struct LoadWindow {
    samples: VecDeque<(Instant, usize)>,
}

impl LoadWindow {
    /// Adds the load seen at `now`, forgets samples older than `window`; the peak of the rest.
    pub fn record(&mut self, now: Instant, load: usize, window: Duration) -> usize {
        self.samples.push_back((now, load));
        while self
            .samples
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > window)
        {
            self.samples.pop_front();
        }
        self.samples
            .iter()
            .map(|(_, load)| *load)
            .max()
            .unwrap_or(0)
    }
}

impl Pool {
    /// Remembers the load now (requests in flight and waiting); returns the peak over the
    /// scale-down window.
    pub(super) fn record_load(&self, inner: &mut Inner, now: Instant, waiting: usize) -> usize {
        let in_flight: usize = inner.instances.iter().map(|i| i.in_flight()).sum();
        inner
            .load
            .record(now, in_flight + waiting, self.config.scale_down_window)
    }

    /// How many instances the load calls for (see [`desired_replicas`]).
    pub(super) fn desired(&self, inner: &mut Inner, now: Instant) -> usize {
        let waiting = self.waiting.load(Ordering::Acquire);
        let peak_load = self.record_load(inner, now, waiting);
        desired_replicas(ScaleInput {
            min: inner.min,
            max: inner.max,
            target: self.config.target_concurrency,
            peak_load,
            waiting,
            idle_for: now.duration_since(*self.last_request.lock()),
            scale_to_zero_after: self.config.scale_to_zero_after,
        })
    }
}
