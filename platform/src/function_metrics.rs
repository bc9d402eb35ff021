//! Per-function metrics, served on the gateway's `/metrics` (both modes): calls by status
//! class, errors, how long calls take, and in local mode cold starts, instance starts by
//! origin, ready instances and how long calls waited for an instance. The gateway records
//! calls, the local supervisor its instances, and the console reads the totals: the series sit
//! below all three.
//!
//! Labels are the namespace, the function and, for calls, the status class (for instance
//! starts, the origin, one of two): bounded by the Functions that exist (a removed Function's
//! series go with it), never a path, a caller or an error text. Each function's series are
//! looked up once ([`FunctionMetrics::function`]), so a call costs a few atomic additions and
//! no label allocation or hashing.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FunctionLabels {
    namespace: String,
    function: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    namespace: String,
    function: String,
    status_class: &'static str,
}

/// The status classes calls are counted by.
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StartLabels {
    namespace: String,
    function: String,
    origin: &'static str,
}

/// Where a local instance's process came from: a warm spare that became it, or a process
/// started for it.
const ORIGINS: [&str; 2] = ["warm_spare", "process"];

/// Every function's series, and the registry `/metrics` encodes.
#[derive(Debug)]
pub struct FunctionMetrics {
    registry: Registry,
    calls: Family<CallLabels, Counter>,
    errors: Family<FunctionLabels, Counter>,
    duration: Family<FunctionLabels, Histogram>,
    cold_starts: Family<FunctionLabels, Counter>,
    instance_starts: Family<StartLabels, Counter>,
    instances: Family<FunctionLabels, Gauge>,
    queue_wait: Family<FunctionLabels, Histogram>,
    /// Each function's series, so every caller of [`Self::function`] shares one and the
    /// dashboard can read them all.
    series: Mutex<HashMap<(String, String), Arc<FunctionSeries>>>,
}

impl Default for FunctionMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Buckets of call and wait durations, in seconds: a warm call takes milliseconds, a start
/// from zero up to seconds, a long handler up to its timeout.
pub const SECONDS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0,
];

/// Calls counted so far by one function's series, for the dashboard's charts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallTotals {
    /// Calls answered.
    pub calls: u64,
    /// Calls answered 5xx.
    pub errors: u64,
    /// Calls by duration: `buckets[i]` took at most `SECONDS[i]` (and more than the bound
    /// before); the last counts those beyond every bound.
    pub buckets: [u64; SECONDS.len() + 1],
}

impl FunctionMetrics {
    /// Registers every metric under `eddy_function_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("eddy_function");
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "calls",
            "Calls of a function through the gateway, by status class of the answer",
            calls.clone(),
        );
        let errors = Family::<FunctionLabels, Counter>::default();
        registry.register(
            "errors",
            "Calls answered 5xx (by the function, or by the gateway when it could not reach one)",
            errors.clone(),
        );
        let duration =
            Family::<FunctionLabels, Histogram>::new_with_constructor(|| Histogram::new(SECONDS));
        registry.register(
            "duration_seconds",
            "Time from a call's arrival at the gateway to the answer's head",
            duration.clone(),
        );
        let cold_starts = Family::<FunctionLabels, Counter>::default();
        registry.register(
            "cold_starts",
            "Instances started because calls were waiting and none was ready (local mode), or wake-ups of a Function at zero replicas for a call (Kubernetes)",
            cold_starts.clone(),
        );
        let instance_starts = Family::<StartLabels, Counter>::default();
        registry.register(
            "instance_starts",
            "Instances started (local mode), by origin: a warm spare that became the instance, or a process started for it",
            instance_starts.clone(),
        );
        let instances = Family::<FunctionLabels, Gauge>::default();
        registry.register(
            "instances",
            "Instances ready to take calls (local mode)",
            instances.clone(),
        );
        let queue_wait =
            Family::<FunctionLabels, Histogram>::new_with_constructor(|| Histogram::new(SECONDS));
        registry.register(
            "queue_wait_seconds",
            "How long calls that found no ready instance (local mode) or pod (Kubernetes) waited for one",
            queue_wait.clone(),
        );
        Self {
            registry,
            calls,
            errors,
            duration,
            cold_starts,
            instance_starts,
            instances,
            queue_wait,
            series: Mutex::default(),
        }
    }

    /// The series of one function, created now (at zero) so it shows before its first call;
    /// the same series for every caller until the function is removed.
    pub fn function(&self, namespace: &str, function: &str) -> Arc<FunctionSeries> {
        let mut series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        series
            .entry((namespace.to_owned(), function.to_owned()))
            .or_insert_with(|| self.create(namespace, function))
            .clone()
    }

    /// Every function's call totals so far, by namespace and name.
    pub fn totals(&self) -> Vec<((String, String), CallTotals)> {
        let series: Vec<_> = self
            .series
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(key, series)| (key.clone(), series.clone()))
            .collect();
        series
            .into_iter()
            .map(|(key, series)| (key, series.totals()))
            .collect()
    }

    fn create(&self, namespace: &str, function: &str) -> Arc<FunctionSeries> {
        let labels = FunctionLabels {
            namespace: namespace.to_owned(),
            function: function.to_owned(),
        };
        let calls = STATUS_CLASSES.map(|status_class| {
            self.calls
                .get_or_create(&CallLabels {
                    namespace: labels.namespace.clone(),
                    function: labels.function.clone(),
                    status_class,
                })
                .clone()
        });
        let instance_starts = ORIGINS.map(|origin| {
            self.instance_starts
                .get_or_create(&StartLabels {
                    namespace: labels.namespace.clone(),
                    function: labels.function.clone(),
                    origin,
                })
                .clone()
        });
        Arc::new(FunctionSeries {
            calls,
            errors: self.errors.get_or_create(&labels).clone(),
            duration: self.duration.get_or_create(&labels).clone(),
            cold_starts: self.cold_starts.get_or_create(&labels).clone(),
            instance_starts,
            instances: self.instances.get_or_create(&labels).clone(),
            queue_wait: self.queue_wait.get_or_create(&labels).clone(),
            buckets: Default::default(),
        })
    }

    /// Drops a removed function's series.
    pub fn remove(&self, namespace: &str, function: &str) {
        self.series
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(namespace.to_owned(), function.to_owned()));
        let labels = FunctionLabels {
            namespace: namespace.to_owned(),
            function: function.to_owned(),
        };
        for status_class in STATUS_CLASSES {
            self.calls.remove(&CallLabels {
                namespace: labels.namespace.clone(),
                function: labels.function.clone(),
                status_class,
            });
        }
        for origin in ORIGINS {
            self.instance_starts.remove(&StartLabels {
                namespace: labels.namespace.clone(),
                function: labels.function.clone(),
                origin,
            });
        }
        self.errors.remove(&labels);
        self.duration.remove(&labels);
        self.cold_starts.remove(&labels);
        self.instances.remove(&labels);
        self.queue_wait.remove(&labels);
    }

    /// The Prometheus text exposition of every series.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// The series of one function.
#[derive(Debug)]
pub struct FunctionSeries {
    calls: [Counter; 5],
    errors: Counter,
    duration: Histogram,
    cold_starts: Counter,
    /// By [`ORIGINS`].
    instance_starts: [Counter; 2],
    instances: Gauge,
    queue_wait: Histogram,
    /// Calls by duration bucket, as [`CallTotals::buckets`] (the histogram keeps its own
    /// counts private).
    buckets: [AtomicU64; SECONDS.len() + 1],
}

impl FunctionSeries {
    /// A call answered `status` after `seconds`.
    pub fn called(&self, status: u16, seconds: f64) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.calls[class].inc();
        if status >= 500 {
            self.errors.inc();
        }
        self.duration.observe(seconds);
        let bucket = SECONDS
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(SECONDS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
    }

    /// The calls counted so far.
    pub fn totals(&self) -> CallTotals {
        CallTotals {
            calls: self.calls.iter().map(Counter::get).sum(),
            errors: self.errors.get(),
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
        }
    }

    /// Instances started from none ready, for calls that were waiting.
    pub fn cold_start(&self) {
        self.cold_starts.inc();
    }

    /// An instance started (`from_spare`: a warm spare became it).
    pub fn instance_started(&self, from_spare: bool) {
        self.instance_starts[usize::from(!from_spare)].inc();
    }

    /// Instances ready now.
    pub fn set_instances(&self, ready: usize) {
        self.instances.set(i64::try_from(ready).unwrap_or(i64::MAX));
    }

    /// The ready instances last set (an atomic read: the gateway asks it on every call).
    pub fn ready_instances(&self) -> i64 {
        self.instances.get()
    }

    /// A call waited `seconds` for an instance.
    pub fn waited(&self, seconds: f64) {
        self.queue_wait.observe(seconds);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_by_status_class_and_removed_with_their_function() {
        let metrics = FunctionMetrics::new();
        let series = metrics.function("shop", "reserve");
        series.called(200, 0.003);
        series.called(204, 0.002);
        series.called(404, 0.001);
        series.called(503, 2.0);
        series.cold_start();
        series.instance_started(true);
        series.instance_started(false);
        series.instance_started(false);
        series.set_instances(2);
        series.waited(0.4);
        let text = metrics.encode();
        for line in [
            r#"eddy_function_calls_total{namespace="shop",function="reserve",status_class="2xx"} 2"#,
            r#"eddy_function_calls_total{namespace="shop",function="reserve",status_class="4xx"} 1"#,
            r#"eddy_function_calls_total{namespace="shop",function="reserve",status_class="5xx"} 1"#,
            r#"eddy_function_calls_total{namespace="shop",function="reserve",status_class="3xx"} 0"#,
            r#"eddy_function_errors_total{namespace="shop",function="reserve"} 1"#,
            r#"eddy_function_duration_seconds_count{namespace="shop",function="reserve"} 4"#,
            r#"eddy_function_cold_starts_total{namespace="shop",function="reserve"} 1"#,
            r#"eddy_function_instance_starts_total{namespace="shop",function="reserve",origin="warm_spare"} 1"#,
            r#"eddy_function_instance_starts_total{namespace="shop",function="reserve",origin="process"} 2"#,
            r#"eddy_function_instances{namespace="shop",function="reserve"} 2"#,
            r#"eddy_function_queue_wait_seconds_count{namespace="shop",function="reserve"} 1"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(
            Arc::ptr_eq(&series, &metrics.function("shop", "reserve")),
            "one series per function"
        );
        let totals = metrics.totals();
        assert_eq!(totals.len(), 1);
        assert_eq!(totals[0].0, ("shop".to_owned(), "reserve".to_owned()));
        let mut buckets = [0; SECONDS.len() + 1];
        buckets[0] = 1; // 1 ms
        buckets[1] = 1; // 2 ms
        buckets[2] = 1; // 3 ms
        buckets[10] = 1; // 2 s
        assert_eq!(
            totals[0].1,
            CallTotals {
                calls: 4,
                errors: 1,
                buckets
            }
        );
        metrics.remove("shop", "reserve");
        assert!(!metrics.encode().contains("reserve"), "series left behind");
        assert!(metrics.totals().is_empty());
    }
}
