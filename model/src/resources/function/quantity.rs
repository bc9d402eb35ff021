//! Resource quantities and the profiles (presets) that name them.

use super::{Quantity, Resources};

/// The profile of a Function that names none (Kyma's default).
pub const DEFAULT_PROFILE: &str = "L";

/// The value of a Kubernetes quantity (`128Mi`, `1G`, `0.5Gi`, `150m`, `1e9`, `512`), or `None`
/// when it is not one.
pub fn quantity_value(text: &str) -> Option<f64> {
    const UNITS: [(&str, f64); 13] = [
        ("Ki", 1024.0),
        ("Mi", 1_048_576.0),
        ("Gi", 1_073_741_824.0),
        ("Ti", 1_099_511_627_776.0),
        ("Pi", 1_125_899_906_842_624.0),
        ("Ei", 1_152_921_504_606_846_976.0),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    let text = text.trim();
    let (number, scale) = UNITS
        .iter()
        .find_map(|(suffix, scale)| text.strip_suffix(suffix).map(|n| (n, *scale)))
        .unwrap_or((text, 1.0));
    let value: f64 = number
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v >= 0.0)?;
    Some(value * scale)
}

/// Bytes of a Kubernetes quantity (rounded up), or `None` when it is not one.
pub fn quantity_bytes(text: &str) -> Option<u64> {
    let bytes = quantity_value(text)?.ceil();
    // Within u64 (an f64 above 2^64 would saturate silently).
    (bytes < 1.8e19).then_some(bytes as u64)
}

/// A preset's (name, cpu request, memory request, cpu limit, memory limit) as resources (the
/// function presets of [`PROFILES`], the build presets of [`BUILD_PROFILE_RESOURCES`]).
pub fn preset_resources(
    (_, cpu_request, memory_request, cpu_limit, memory_limit): (&str, &str, &str, &str, &str),
) -> Resources {
    let quantities = |pairs: [(&str, &str); 2]| {
        pairs
            .into_iter()
            .map(|(name, value)| (name.to_owned(), Quantity(value.to_owned())))
            .collect()
    };
    Resources {
        requests: quantities([("cpu", cpu_request), ("memory", memory_request)]),
        limits: quantities([("cpu", cpu_limit), ("memory", memory_limit)]),
    }
}

/// Presets of `resourceConfiguration.function.profile`: (cpu request, memory request, cpu limit,
/// memory limit).
pub const PROFILES: [(&str, &str, &str, &str, &str); 5] = [
    ("XS", "50m", "64Mi", "150m", "256Mi"),
    ("S", "100m", "128Mi", "200m", "256Mi"),
    ("M", "200m", "256Mi", "400m", "512Mi"),
    ("L", "400m", "512Mi", "800m", "1024Mi"),
    ("XL", "800m", "1024Mi", "1600m", "2048Mi"),
];
