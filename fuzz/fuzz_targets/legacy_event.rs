//! The legacy `/{application}/v1/events` format: parsing must never panic; an accepted event
//! keeps the invariants SECURITY.md promises (`OutgoingEvent::check_invariants`).
#![no_main]

use eddy_model::{event::Limits, legacy::from_legacy};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_event_size: 1 << 16,
    max_batch_events: 100,
};

fuzz_target!(|body: &[u8]| {
    if let Ok(event) = from_legacy("shop", body, &LIMITS, || "generated-id".to_owned()) {
        if let Err(broken) = event.check_invariants(&LIMITS) {
            panic!("accepted event breaks an invariant: {broken}");
        }
    }
});
