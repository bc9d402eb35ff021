//! Subject escaping: any source and type map to a subject made of valid tokens (or are refused
//! with an error), and the subject maps back to exactly that source and type.
#![no_main]

use eddy_model::subject::{escape_token, event_subject, parse_event_subject, unescape_token};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let text = String::from_utf8_lossy(input);
    let (source, ty) = text
        .split_once('\u{0}')
        .unwrap_or((&text, "order.created.v1"));
    let token = escape_token(source);
    assert!(!token.is_empty() || source.is_empty());
    assert!(
        token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'~'),
        "{token:?}"
    );
    assert_eq!(unescape_token(&token).as_deref(), Some(source));
    if let Ok(subject) = event_subject(source, ty) {
        assert!(
            !subject.contains(['*', '>', ' ', '\t', '\r', '\n']),
            "{subject:?}"
        );
        let (back_source, back_type) =
            parse_event_subject(&subject).expect("our own subject parses");
        assert_eq!((back_source.as_str(), back_type.as_str()), (source, ty));
    }
});
