//! Structured and batch CloudEvents bodies: parsing must never panic, and every accepted event
//! must keep the invariants SECURITY.md promises (`OutgoingEvent::check_invariants`).
#![no_main]

use eddy_model::event::{Limits, TraceContext, from_batch, from_structured};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_event_size: 1 << 16,
    max_batch_events: 100,
};

fuzz_target!(|body: &[u8]| {
    let trace = TraceContext::default();
    let accepted = from_structured(body, &trace, &LIMITS)
        .into_iter()
        .chain(from_batch(body, &trace, &LIMITS).into_iter().flatten());
    for event in accepted {
        if let Err(broken) = event.check_invariants(&LIMITS) {
            panic!("accepted event breaks an invariant: {broken}");
        }
    }
});
