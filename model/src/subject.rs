//! Subject naming for events stored in JetStream.
//!
//! An event with source `S` and type `a.b.c` is stored under `eddy.events.<S>.<a>.<b>.<c>`. The
//! source is one token and the type keeps its dots as token separators, so that subscriptions can
//! filter by type prefix with NATS wildcards. Every token is escaped: bytes outside
//! `[A-Za-z0-9_-]` become `~XX` (upper-case hex), `~` included, so any CloudEvents source and type
//! maps to a valid subject and back, and two different events never share a subject by accident.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};

/// Prefix of every event subject (the `EDDY_EVENTS` stream binds `eddy.events.>`).
pub const EVENTS_SUBJECT_PREFIX: &str = "eddy.events";
/// Prefix of every dead-letter subject (the `EDDY_DEAD_LETTERS` stream binds `eddy.dlq.>`).
pub const DEAD_LETTER_SUBJECT_PREFIX: &str = "eddy.dlq";
/// Longest subject we will publish. NATS bounds the whole protocol line (4 KiB by default), so
/// sources and types that would come close to it are refused up front.
pub const MAX_SUBJECT_LEN: usize = 2048;

/// Why a source, type or subject could not be mapped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    /// The CloudEvents `source` is empty.
    #[error("source must not be empty")]
    EmptySource,
    /// The CloudEvents `type` is empty or has an empty dot-separated segment (`a..b`, `.a`, `a.`).
    #[error("type `{0}` has an empty segment; segments are separated by single dots")]
    EmptyTypeSegment(String),
    /// The subject would be longer than [`MAX_SUBJECT_LEN`].
    #[error(
        "source and type are too long together: the subject would be {0} bytes (at most {MAX_SUBJECT_LEN})"
    )]
    TooLong(usize),
    /// A subject that was not produced by [`event_subject`].
    #[error("`{0}` is not an eddy event subject")]
    NotAnEventSubject(String),
}

fn is_plain(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-'
}

/// Appends `raw` to `out` as one escaped subject token.
pub fn escape_token_into(raw: &str, out: &mut String) {
    for &byte in raw.as_bytes() {
        if is_plain(byte) {
            out.push(char::from(byte));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(out, "~{byte:02X}");
        }
    }
}

/// Escapes `raw` as one subject token.
pub fn escape_token(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    escape_token_into(raw, &mut out);
    out
}

/// Reverses [`escape_token`]. Refuses anything `escape_token` cannot have produced (lower-case
/// hex, plain bytes outside the kept set, truncated escapes), so the mapping stays one-to-one.
pub fn unescape_token(token: &str) -> Option<String> {
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte == b'~' {
            let hi = hex_value(*bytes.get(i + 1)?)?;
            let lo = hex_value(*bytes.get(i + 2)?)?;
            let decoded = (hi << 4) | lo;
            if is_plain(decoded) {
                return None;
            }
            out.push(decoded);
            i += 3;
        } else if is_plain(byte) {
            out.push(byte);
            i += 1;
        } else {
            return None;
        }
    }
    String::from_utf8(out).ok()
}

fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// The subject an event with this `source` and `type` is stored under.
pub fn event_subject(source: &str, ty: &str) -> Result<String, SubjectError> {
    if source.is_empty() {
        return Err(SubjectError::EmptySource);
    }
    let mut subject =
        String::with_capacity(EVENTS_SUBJECT_PREFIX.len() + source.len() + ty.len() + 8);
    subject.push_str(EVENTS_SUBJECT_PREFIX);
    subject.push('.');
    escape_token_into(source, &mut subject);
    for segment in ty.split('.') {
        if segment.is_empty() {
            return Err(SubjectError::EmptyTypeSegment(ty.to_owned()));
        }
        subject.push('.');
        escape_token_into(segment, &mut subject);
    }
    if subject.len() > MAX_SUBJECT_LEN {
        return Err(SubjectError::TooLong(subject.len()));
    }
    Ok(subject)
}

/// Recovers `(source, type)` from a subject made by [`event_subject`].
pub fn parse_event_subject(subject: &str) -> Result<(String, String), SubjectError> {
    let not_ours = || SubjectError::NotAnEventSubject(subject.to_owned());
    let rest = subject
        .strip_prefix(EVENTS_SUBJECT_PREFIX)
        .and_then(|rest| rest.strip_prefix('.'))
        .ok_or_else(not_ours)?;
    let mut tokens = rest.split('.');
    let source = tokens
        .next()
        .and_then(unescape_token)
        .ok_or_else(not_ours)?;
    if source.is_empty() {
        return Err(not_ours());
    }
    let mut ty = String::new();
    for token in tokens {
        let segment = unescape_token(token).ok_or_else(not_ours)?;
        if segment.is_empty() {
            return Err(not_ours());
        }
        if !ty.is_empty() {
            ty.push('.');
        }
        ty.push_str(&segment);
    }
    if ty.is_empty() {
        return Err(not_ours());
    }
    Ok((source, ty))
}

/// The dead-letter subject of one Subscription.
pub fn dead_letter_subject(namespace: &str, subscription: &str) -> String {
    let mut subject = String::from(DEAD_LETTER_SUBJECT_PREFIX);
    subject.push('.');
    escape_token_into(namespace, &mut subject);
    subject.push('.');
    escape_token_into(subscription, &mut subject);
    subject
}

/// The `Nats-Msg-Id` of an event: a digest of (source, id), the pair CloudEvents defines as
/// unique, so a publisher that retries is stored once inside the duplicate window. The source's
/// length goes first so that `("ab", "c")` and `("a", "bc")` differ.
pub fn message_id(source: &str, id: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update((source.len() as u64).to_be_bytes());
    hasher.update(source.as_bytes());
    hasher.update(id.as_bytes());
    let digest = hasher.finalize();
    let mut out = String::with_capacity(32);
    for byte in &digest[..16] {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0xF)]));
    }
    out
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Whether a NATS subject `filter` (`*` one token, `>` one or more at the end) takes
/// `subject`, as the server decides it for a consumer's filter subjects. Pure.
pub fn filter_matches(filter: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for wanted in filter.split('.') {
        if wanted == ">" {
            return tokens.next().is_some();
        }
        match tokens.next() {
            Some(token) if wanted == "*" || wanted == token => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn filters_match_as_nats_matches_them() {
        for (filter, subject, matches) in [
            (
                "eddy.events.shop.order.created",
                "eddy.events.shop.order.created",
                true,
            ),
            (
                "eddy.events.*.order.created",
                "eddy.events.crm.order.created",
                true,
            ),
            (
                "eddy.events.shop.order.>",
                "eddy.events.shop.order.created.v1",
                true,
            ),
            ("eddy.events.shop.order.>", "eddy.events.shop.order", false),
            (
                "eddy.events.*.order",
                "eddy.events.shop.order.created",
                false,
            ),
            (
                "eddy.events.shop.order.created",
                "eddy.events.shop.order",
                false,
            ),
            ("eddy.events.*.>", "eddy.events.shop.a", true),
        ] {
            assert_eq!(
                filter_matches(filter, subject),
                matches,
                "{filter} {subject}"
            );
        }
    }

    #[test]
    fn plain_names_stay_readable() {
        assert_eq!(
            event_subject("shop", "order.created.v1").unwrap(),
            "eddy.events.shop.order.created.v1"
        );
    }

    #[test]
    fn uri_sources_are_one_token() {
        assert_eq!(
            event_subject("https://shop.example/orders", "order.created").unwrap(),
            "eddy.events.https~3A~2F~2Fshop~2Eexample~2Forders.order.created"
        );
    }

    #[test]
    fn escape_character_and_wildcards_are_escaped() {
        assert_eq!(escape_token("a~b*>c d"), "a~7Eb~2A~3Ec~20d");
        assert_eq!(escape_token("ü"), "~C3~BC");
    }

    #[test]
    fn empty_segments_are_refused() {
        for ty in ["", ".a", "a.", "a..b"] {
            assert_eq!(
                event_subject("s", ty),
                Err(SubjectError::EmptyTypeSegment(ty.to_owned())),
                "{ty:?}"
            );
        }
        assert_eq!(event_subject("", "a"), Err(SubjectError::EmptySource));
    }

    #[test]
    fn overlong_subjects_are_refused() {
        let source = "s".repeat(MAX_SUBJECT_LEN);
        assert!(matches!(
            event_subject(&source, "t"),
            Err(SubjectError::TooLong(_))
        ));
    }

    #[test]
    fn foreign_escapes_are_refused() {
        for token in ["~2a", "~41", "~4", "a.b", "a*", "~"] {
            assert_eq!(unescape_token(token), None, "{token:?}");
        }
        assert!(parse_event_subject("eddy.other.a.b").is_err());
        assert!(parse_event_subject("eddy.events.a").is_err());
    }

    #[test]
    fn dead_letter_subjects_escape_names() {
        assert_eq!(
            dead_letter_subject("default", "on.order"),
            "eddy.dlq.default.on~2Eorder"
        );
    }

    proptest! {
        #[test]
        fn tokens_round_trip(raw in any::<String>()) {
            let token = escape_token(&raw);
            prop_assert!(token.bytes().all(|b| is_plain(b) || b == b'~'));
            prop_assert_eq!(unescape_token(&token), Some(raw));
        }

        #[test]
        fn subjects_round_trip(
            source in any::<String>().prop_filter("non-empty", |s| !s.is_empty()),
            segments in prop::collection::vec(any::<String>().prop_filter("non-empty", |s| !s.is_empty() && !s.contains('.')), 1..5),
        ) {
            let ty = segments.join(".");
            let subject = event_subject(&source, &ty).unwrap();
            prop_assert_eq!(parse_event_subject(&subject).unwrap(), (source, ty));
        }

        #[test]
        fn different_events_never_share_a_subject(
            a in ("[a-z.~/:%]{1,6}", "[a-z.~]{1,6}"),
            b in ("[a-z.~/:%]{1,6}", "[a-z.~]{1,6}"),
        ) {
            if let (Ok(sa), Ok(sb)) = (event_subject(&a.0, &a.1), event_subject(&b.0, &b.1)) {
                prop_assert_eq!(sa == sb, a == b);
            }
        }
    }

    #[test]
    fn message_ids_separate_source_from_id() {
        assert_ne!(message_id("ab", "c"), message_id("a", "bc"));
        assert_eq!(message_id("shop", "1"), message_id("shop", "1"));
        assert_eq!(message_id("shop", "1").len(), 32);
    }
}
