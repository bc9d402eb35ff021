//! One delivery: a stored event POSTed to a sink in binary content mode, and what the answer
//! means. The classification is pure so every rule is tested without a server.

use std::borrow::Cow;

use async_nats::HeaderMap as NatsHeaders;
use bytes::Bytes;
use eddy_model::headers as names;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

/// Characters the CloudEvents HTTP binding says to percent-encode in `ce-*` values (besides
/// everything outside printable ASCII).
const CE_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// Why a delivery failed, or what else went wrong with it: the `reason` of metrics, logs and the
/// `eddy-dlq-reason` header, a fixed vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// The sink answered 408.
    Http408,
    /// The sink answered 429.
    Http429,
    /// The sink answered 5xx.
    Http5xx,
    /// The sink answered 3xx (redirects are not followed).
    Http3xx,
    /// The sink answered 4xx (not 408 or 429).
    Http4xx,
    /// The sink answered a status outside 200..=599.
    HttpUnexpected,
    /// No connection to the sink.
    ConnectError,
    /// The connection failed during the exchange.
    TransportError,
    /// No answer within the Subscription's timeout.
    Timeout,
    /// The sink's function has no address yet.
    SinkUnresolved,
    /// The sink is not a function and not an allowed URL.
    SinkNotAllowed,
    /// The sink is not a valid URL.
    SinkInvalid,
    /// The sink's reply event was not stored (retried with the delivery).
    ReplyNotStored,
    /// The sink's reply was not a valid event, or too large for NATS (dropped).
    ReplyRefused,
    /// The sink's answer was too large (or broken) to be a reply (ignored).
    ReplyTooLarge,
    /// The dead letter could not be stored (the event stays and comes back).
    DeadLetterUnavailable,
    /// Every attempt failed.
    MaxAttempts,
}

impl Failure {
    /// The label, as metrics, logs and dead letters show it.
    pub fn label(self) -> &'static str {
        match self {
            Self::Http408 => "http_408",
            Self::Http429 => "http_429",
            Self::Http5xx => "http_5xx",
            Self::Http3xx => "http_3xx",
            Self::Http4xx => "http_4xx",
            Self::HttpUnexpected => "http_unexpected",
            Self::ConnectError => "connect_error",
            Self::TransportError => "transport_error",
            Self::Timeout => "timeout",
            Self::SinkUnresolved => "sink_unresolved",
            Self::SinkNotAllowed => "sink_not_allowed",
            Self::SinkInvalid => "sink_invalid",
            Self::ReplyNotStored => "reply_not_stored",
            Self::ReplyRefused => "reply_refused",
            Self::ReplyTooLarge => "reply_too_large",
            Self::DeadLetterUnavailable => "dead_letter_unavailable",
            Self::MaxAttempts => "max_attempts",
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// What to do with an event after a delivery attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The sink took it (2xx).
    Delivered {
        /// The status.
        status: u16,
    },
    /// It may succeed later: nak with backoff (or dead-letter when attempts are used up).
    Retry {
        /// Why.
        reason: Failure,
        /// The sink's status, when it answered.
        status: Option<u16>,
    },
    /// It will never succeed: dead-letter now.
    Dead {
        /// Why.
        reason: Failure,
        /// The sink's status, when it answered.
        status: Option<u16>,
    },
}

/// Classifies an HTTP status: 2xx delivered; 408, 429 and 5xx retried; anything else permanent.
pub fn classify_status(status: u16) -> Verdict {
    match status {
        200..=299 => Verdict::Delivered { status },
        408 => Verdict::Retry {
            reason: Failure::Http408,
            status: Some(status),
        },
        429 => Verdict::Retry {
            reason: Failure::Http429,
            status: Some(status),
        },
        500..=599 => Verdict::Retry {
            reason: Failure::Http5xx,
            status: Some(status),
        },
        300..=399 => Verdict::Dead {
            reason: Failure::Http3xx,
            status: Some(status),
        },
        400..=499 => Verdict::Dead {
            reason: Failure::Http4xx,
            status: Some(status),
        },
        _ => Verdict::Dead {
            reason: Failure::HttpUnexpected,
            status: Some(status),
        },
    }
}

/// Classifies a transport failure: all of them may pass. (Timeouts are the caller's: it owns
/// the deadline.)
pub fn classify_error(error: &hyper_util::client::legacy::Error) -> Verdict {
    let reason = if error.is_connect() {
        Failure::ConnectError
    } else {
        Failure::TransportError
    };
    Verdict::Retry {
        reason,
        status: None,
    }
}

/// How `ce-*` values are written on a binary-mode delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttributeEncoding {
    /// Percent-encoded as the CloudEvents HTTP binding says (space, `"`, `%` and everything
    /// outside printable ASCII): eddy's own Subscriptions.
    #[default]
    Binding,
    /// As they are, UTF-8 included, as Kyma's dispatcher (CloudEvents' Go SDK) writes them and
    /// a sink built on that SDK reads them: Subscriptions applied in Kyma's form. The values
    /// hold no control characters (refused on publish), so each is a valid header value.
    Raw,
}

/// Turns the stored NATS headers into HTTP headers for a binary-mode request: `ce-*` values
/// written as `encoding` says, `content-type` and trace context as they are.
pub fn http_headers(stored: &NatsHeaders, encoding: AttributeEncoding) -> http::HeaderMap {
    let mut headers = http::HeaderMap::with_capacity(12);
    for (name, values) in stored.iter() {
        let name: &str = name.as_ref();
        let Some(value) = values.first() else {
            continue;
        };
        let value = value.as_str();
        let encoded: Cow<'_, str> = if name.starts_with(names::CE_PREFIX) {
            match encoding {
                AttributeEncoding::Binding => utf8_percent_encode(value, CE_VALUE).into(),
                AttributeEncoding::Raw => Cow::Borrowed(value),
            }
        } else if name == names::CONTENT_TYPE
            || name == names::TRACEPARENT
            || name == names::TRACESTATE
        {
            Cow::Borrowed(value)
        } else {
            continue;
        };
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_bytes(encoded.as_bytes()),
        ) {
            headers.insert(name, value);
        }
    }
    headers
}

/// A CloudEvent carried by a sink's 2xx answer, to be published back to the event-bus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Headers to send to the event-bus (`ce-*` and `content-type`).
    pub headers: http::HeaderMap,
    /// The body.
    pub body: Bytes,
}

/// Whether an answer may carry a reply event: binary mode (`ce-specversion` header) or
/// structured mode (`application/cloudevents+json`). Anything else is a plain answer.
pub fn may_carry_reply(answer_headers: &http::HeaderMap) -> bool {
    answer_headers.contains_key("ce-specversion")
        || answer_headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|content_type| {
                content_type
                    .get(..names::CLOUDEVENTS_JSON.len())
                    .is_some_and(|start| start.eq_ignore_ascii_case(names::CLOUDEVENTS_JSON))
            })
}

/// Finds a reply event in an answer (see [`may_carry_reply`]).
pub fn reply_event(answer_headers: &http::HeaderMap, body: Bytes) -> Option<Reply> {
    if !may_carry_reply(answer_headers) {
        return None;
    }
    let mut headers = http::HeaderMap::new();
    for (name, value) in answer_headers {
        let name_text = name.as_str();
        if name_text.starts_with(names::CE_PREFIX) || name == http::header::CONTENT_TYPE {
            headers.append(name.clone(), value.clone());
        }
    }
    Some(Reply { headers, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        assert_eq!(classify_status(200), Verdict::Delivered { status: 200 });
        assert_eq!(classify_status(204), Verdict::Delivered { status: 204 });
        for retried in [408, 429, 500, 502, 503, 504] {
            assert!(
                matches!(classify_status(retried), Verdict::Retry { .. }),
                "{retried}"
            );
        }
        for dead in [301, 400, 401, 403, 404, 410, 413, 422] {
            assert!(
                matches!(classify_status(dead), Verdict::Dead { .. }),
                "{dead}"
            );
        }
    }

    #[test]
    fn stored_headers_become_encoded_http_headers() {
        let mut stored = NatsHeaders::new();
        stored.insert("ce-id", "1");
        stored.insert("ce-subject", "a b%\"ü");
        stored.insert("content-type", "application/json; charset=utf-8");
        stored.insert("traceparent", "00-abc-def-01");
        stored.insert("Nats-Msg-Id", "digest");
        let headers = http_headers(&stored, AttributeEncoding::Binding);
        assert_eq!(headers["ce-id"], "1");
        assert_eq!(headers["ce-subject"], "a%20b%25%22%C3%BC");
        assert_eq!(headers["content-type"], "application/json; charset=utf-8");
        assert_eq!(headers["traceparent"], "00-abc-def-01");
        assert!(!headers.contains_key("nats-msg-id"));
        // Kyma's form: as sdk-go writes them, UTF-8 bytes as they are.
        let raw = http_headers(&stored, AttributeEncoding::Raw);
        assert_eq!(raw["ce-subject"].as_bytes(), "a b%\"ü".as_bytes());
        assert_eq!(raw["content-type"], "application/json; charset=utf-8");
    }

    #[test]
    fn replies_are_recognized_in_both_modes() {
        let mut binary = http::HeaderMap::new();
        binary.insert("ce-specversion", "1.0".parse().unwrap());
        binary.insert("ce-type", "stock.reserved.v1".parse().unwrap());
        binary.insert("content-type", "application/json".parse().unwrap());
        binary.insert("x-other", "1".parse().unwrap());
        let reply = reply_event(&binary, Bytes::from_static(b"{}")).unwrap();
        assert_eq!(reply.headers.len(), 3);
        let mut structured = http::HeaderMap::new();
        structured.insert(
            "content-type",
            "application/cloudevents+json".parse().unwrap(),
        );
        assert!(reply_event(&structured, Bytes::from_static(b"{}")).is_some());
        let mut plain = http::HeaderMap::new();
        plain.insert("content-type", "application/json".parse().unwrap());
        assert!(reply_event(&plain, Bytes::from_static(b"{}")).is_none());
        assert!(!may_carry_reply(&plain));
        let mut upper = http::HeaderMap::new();
        upper.insert(
            "content-type",
            "Application/CloudEvents+JSON; charset=utf-8"
                .parse()
                .unwrap(),
        );
        assert!(may_carry_reply(&upper), "media types are case-insensitive");
        let mut short = http::HeaderMap::new();
        short.insert("content-type", "text".parse().unwrap());
        assert!(!may_carry_reply(&short));
        assert!(!may_carry_reply(&http::HeaderMap::new()));
    }
}
