//! Binary-mode CloudEvents: the input is a header block (`name: value` lines, an empty line)
//! and a body. Parsing must never panic, and an accepted event must keep every invariant
//! SECURITY.md promises (`OutgoingEvent::check_invariants`).
#![no_main]

use bytes::Bytes;
use eddy_model::event::{Limits, from_binary};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_event_size: 1 << 16,
    max_batch_events: 100,
};

fuzz_target!(|input: &[u8]| {
    let split = input
        .windows(2)
        .position(|w| w == b"\n\n")
        .unwrap_or(input.len());
    let (head, body) = input.split_at(split);
    let mut headers = http::HeaderMap::new();
    for line in head.split(|b| *b == b'\n') {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let (name, value) = line.split_at(colon);
        let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name),
            http::HeaderValue::from_bytes(value[1..].trim_ascii()),
        ) else {
            continue;
        };
        headers.append(name, value);
    }
    if let Ok(event) = from_binary(&headers, Bytes::copy_from_slice(body), &LIMITS) {
        for required in ["ce-id", "ce-source", "ce-type", "ce-specversion"] {
            assert!(
                headers.contains_key(required),
                "accepted without {required}"
            );
        }
        if let Err(broken) = event.check_invariants(&LIMITS) {
            panic!("accepted event breaks an invariant: {broken}");
        }
    }
});
