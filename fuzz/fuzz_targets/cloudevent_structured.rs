//! Structured and batch CloudEvents bodies: parsing must never panic.
#![no_main]

use eddy_event_bus::event::{Limits, TraceContext, from_batch, from_structured};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_event_size: 1 << 16,
    max_batch_events: 100,
};

fuzz_target!(|body: &[u8]| {
    let trace = TraceContext::default();
    let _ = from_structured(body, &trace, &LIMITS);
    let _ = from_batch(body, &trace, &LIMITS);
});
