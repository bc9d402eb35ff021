//! Turning what publishers send into what JetStream stores.
//!
//! Every content mode ends as one [`OutgoingEvent`]: a binary-mode NATS message (`ce-*` headers,
//! `content-type`, trace context, the data untouched as payload) with its subject and message id.
//! This module is pure: no I/O, so every rule here is tested directly.
//!
//! CloudEvents are parsed with the official SDK (`cloudevents-sdk`). A small check runs before it
//! so that every refusal names the attribute at fault, which the SDK's messages do not always do,
//! and so that nothing the SDK accepts can break a NATS or HTTP header (control characters).

use std::borrow::Cow;

use crate::{
    headers as names,
    subject::{self, message_id},
};
use bytes::Bytes;
use chrono::SecondsFormat;
use cloudevents::{AttributesReader, Data, Event, event::AttributeValue};
use indexmap::IndexMap;
use serde::de::{DeserializeSeed, SeqAccess, Visitor};
use serde_json::{Map, Value, value::RawValue};

/// One event, ready for JetStream.
#[derive(Debug, Clone)]
pub struct OutgoingEvent {
    /// `eddy.events.<source>.<type>`.
    pub subject: String,
    /// `Nats-Msg-Id`, a digest of (source, id).
    pub msg_id: String,
    /// `ce-*`, `content-type` and trace headers.
    pub headers: EventHeaders,
    /// The event's data, as sent.
    pub payload: Bytes,
    /// The CloudEvents id.
    pub id: String,
    /// The CloudEvents source.
    pub source: String,
}

impl OutgoingEvent {
    /// What every accepted event keeps, as SECURITY.md promises; the property tests and the fuzz
    /// targets assert it on whatever the parsers accept: no control character in any header
    /// (nothing can break a NATS or HTTP header downstream), the stored message within the size
    /// limit, the required attributes present, and a subject that parses back to exactly the
    /// event's source and type (no wildcard or extra token injected).
    pub fn check_invariants(&self, limits: &Limits) -> Result<(), BrokenInvariant> {
        let mut size = "NATS/1.0\r\n\r\n".len() + self.payload.len();
        for (name, text) in self.headers.iter() {
            if text.chars().any(char::is_control) {
                return Err(BrokenInvariant::ControlCharacter {
                    header: name.to_owned(),
                    value: text.to_owned(),
                });
            }
            size += name.len() + text.len() + 4;
        }
        if size > limits.max_event_size {
            return Err(BrokenInvariant::TooLarge {
                size,
                limit: limits.max_event_size,
            });
        }
        let attribute = |name: &str| self.headers.get(name);
        for required in ["ce-specversion", "ce-id", "ce-source", "ce-type"] {
            if attribute(required).is_none_or(str::is_empty) {
                return Err(BrokenInvariant::MissingAttribute(required));
            }
        }
        let parsed = subject::parse_event_subject(&self.subject).map_err(|source| {
            BrokenInvariant::Subject {
                subject: self.subject.clone(),
                source,
            }
        })?;
        let expected = (
            attribute("ce-source").unwrap_or_default(),
            attribute("ce-type").unwrap_or_default(),
        );
        if (parsed.0.as_str(), parsed.1.as_str()) != expected || self.source != expected.0 {
            return Err(BrokenInvariant::SubjectMismatch {
                subject: self.subject.clone(),
                names: parsed,
                event: (expected.0.to_owned(), expected.1.to_owned()),
            });
        }
        if self.msg_id != message_id(&self.source, &self.id) {
            return Err(BrokenInvariant::MessageId);
        }
        Ok(())
    }
}

/// An invariant an accepted event breaks ([`OutgoingEvent::check_invariants`]): a bug in the
/// parsers, found by the property tests and the fuzz targets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BrokenInvariant {
    /// A header value with a control character.
    #[error("control character in header {header}: {value:?}")]
    ControlCharacter {
        /// The header's name.
        header: String,
        /// Its value.
        value: String,
    },
    /// The stored message is over the size limit.
    #[error("{size} bytes stored, the limit is {limit}")]
    TooLarge {
        /// Bytes the stored message takes.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A required CloudEvents attribute is missing or empty.
    #[error("accepted without {0}")]
    MissingAttribute(&'static str),
    /// The subject does not parse back.
    #[error("subject {subject} does not parse: {source}")]
    Subject {
        /// The subject.
        subject: String,
        /// Why it does not parse.
        source: subject::SubjectError,
    },
    /// The subject names another source or type than the event's.
    #[error("subject {subject} names {names:?}, the event is {event:?}")]
    SubjectMismatch {
        /// The subject.
        subject: String,
        /// The source and type it names.
        names: (String, String),
        /// The event's source and type.
        event: (String, String),
    },
    /// The message id is not the digest of (source, id).
    #[error("the message id is not the digest of (source, id)")]
    MessageId,
}

/// The headers of a stored event in the order they were set: names are `ce-*` attributes,
/// `content-type` and trace context, values are text without control characters (checked as they
/// are set), so a NATS client turns them into its own header map without further checks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventHeaders {
    entries: Vec<(Cow<'static, str>, String)>,
}

impl EventHeaders {
    /// The value of `name`, if set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    /// Every header, in the order set.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries
            .iter()
            .map(|(name, value)| (name.as_ref(), value.as_str()))
    }

    /// Every header, by value, in the order set.
    pub fn into_entries(self) -> impl Iterator<Item = (Cow<'static, str>, String)> {
        self.entries.into_iter()
    }

    /// The size NATS gives them in a message: the header preamble and each `name: value`.
    pub fn encoded_size(&self) -> usize {
        let lines: usize = self
            .entries
            .iter()
            .map(|(name, value)| name.len() + value.len() + 4)
            .sum();
        "NATS/1.0\r\n\r\n".len() + lines
    }

    pub(crate) fn push(&mut self, name: Cow<'static, str>, value: String) {
        self.entries.push((name, value));
    }

    /// Sets `name` to `value`, replacing the value it had. For headers the platform itself
    /// writes (the trace context of the span that stores the event); `value` must not contain
    /// control characters, which NATS headers cannot carry.
    pub fn set(&mut self, name: &'static str, value: String) {
        match self.entries.iter_mut().find(|(key, _)| key == name) {
            Some((_, old)) => *old = value,
            None => self.entries.push((Cow::Borrowed(name), value)),
        }
    }
}

/// Why an event was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Malformed or invalid: 400.
    Invalid,
    /// Over the size limit: 413.
    TooLarge,
    /// A content mode or format we do not speak: 415.
    Unsupported,
}

/// A refused event: what is wrong and, where one attribute is at fault, its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventError {
    /// How it maps to HTTP.
    pub refusal: Refusal,
    /// The attribute or field at fault.
    pub field: Option<Cow<'static, str>>,
    /// A sentence for the publisher.
    pub message: String,
}

impl EventError {
    /// An invalid attribute.
    pub fn invalid(field: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        let field = field.into();
        let message = format!("`{field}`: {}", message.into());
        Self {
            refusal: Refusal::Invalid,
            field: Some(field),
            message,
        }
    }

    /// An invalid request as a whole.
    pub fn malformed(message: impl Into<String>) -> Self {
        Self {
            refusal: Refusal::Invalid,
            field: None,
            message: message.into(),
        }
    }

    /// Too large.
    pub fn too_large(size: usize, limit: usize) -> Self {
        Self {
            refusal: Refusal::TooLarge,
            field: None,
            message: format!("event is {size} bytes, the limit is {limit} bytes"),
        }
    }

    /// A batch with more events than allowed.
    pub fn too_many_events(limit: usize) -> Self {
        Self {
            refusal: Refusal::TooLarge,
            field: None,
            message: format!("batch has more events than the limit of {limit}"),
        }
    }

    /// Not a content mode we accept.
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self {
            refusal: Refusal::Unsupported,
            field: None,
            message: message.into(),
        }
    }
}

/// Which of the CloudEvents HTTP content modes a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentMode {
    /// Attributes in `ce-*` headers, data as the body.
    Binary,
    /// One `application/cloudevents+json` document.
    Structured,
    /// An `application/cloudevents-batch+json` array.
    Batch,
}

/// Picks the content mode from the request headers.
pub fn content_mode(headers: &http::HeaderMap) -> Result<ContentMode, EventError> {
    let media_type = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .map(|value| {
            value
                .split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
        });
    match media_type.as_deref() {
        Some(names::CLOUDEVENTS_BATCH_JSON) => Ok(ContentMode::Batch),
        Some(names::CLOUDEVENTS_JSON) => Ok(ContentMode::Structured),
        Some(other) if other.starts_with("application/cloudevents") => {
            Err(EventError::unsupported(format!(
                "event format `{other}` is not supported; use application/cloudevents+json"
            )))
        }
        _ if headers.contains_key("ce-specversion") => Ok(ContentMode::Binary),
        _ => Err(EventError::unsupported(
            "unknown content mode: send the attributes as ce-* headers (binary mode), or the \
             event as application/cloudevents+json (structured mode), or a batch as \
             application/cloudevents-batch+json",
        )),
    }
}

/// Limits applied to every event.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest stored message: data plus headers, in bytes.
    pub max_event_size: usize,
    /// Most events in one batch.
    pub max_batch_events: usize,
}

/// Trace context of the HTTP request, copied onto every stored event.
#[derive(Debug, Clone, Default)]
pub struct TraceContext {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl TraceContext {
    /// Takes `traceparent` and `tracestate` from the request (ignored when not valid text).
    pub fn from_http(headers: &http::HeaderMap) -> Self {
        let take = |name: &str| {
            headers
                .get(name)
                .and_then(|value| value.to_str().ok())
                .filter(|value| !value.contains(['\r', '\n']))
                .map(str::to_owned)
        };
        Self {
            traceparent: take(names::TRACEPARENT),
            tracestate: take(names::TRACESTATE),
        }
    }
}

/// Accumulates the stored headers, refusing names and values NATS could not carry.
struct HeaderBuilder {
    headers: EventHeaders,
}

impl HeaderBuilder {
    fn new() -> Self {
        Self {
            headers: EventHeaders::default(),
        }
    }

    fn insert(
        &mut self,
        attribute: &str,
        name: impl Into<Cow<'static, str>>,
        value: &str,
    ) -> Result<(), EventError> {
        let name = name.into();
        let is_token = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !is_token {
            return Err(EventError::invalid(
                attribute.to_owned(),
                "not a valid attribute name",
            ));
        }
        if value.contains(['\r', '\n']) {
            return Err(EventError::invalid(
                attribute.to_owned(),
                "value must not contain control characters",
            ));
        }
        if self.headers.get(&name).is_some() {
            return Err(EventError::invalid(
                attribute.to_owned(),
                "given more than once",
            ));
        }
        self.headers.push(name, value.to_owned());
        Ok(())
    }

    fn insert_trace(&mut self, trace: &TraceContext) {
        for (name, value) in [
            (names::TRACEPARENT, &trace.traceparent),
            (names::TRACESTATE, &trace.tracestate),
        ] {
            if let Some(value) = value {
                self.headers.push(Cow::Borrowed(name), value.clone());
            }
        }
    }
}

/// CloudEvents attribute names: lower-case ASCII letters and digits.
fn check_attribute_name(name: &str) -> Result<(), EventError> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(EventError::invalid(
            name.to_owned(),
            "attribute names must consist of lower-case letters (a-z) and digits (0-9)",
        ));
    }
    if name == "data" {
        return Err(EventError::invalid("data", "`data` is not an attribute"));
    }
    Ok(())
}

fn check_text(name: &str, value: &str) -> Result<(), EventError> {
    if value.chars().any(char::is_control) {
        return Err(EventError::invalid(
            name.to_owned(),
            "value must not contain control characters",
        ));
    }
    Ok(())
}

const REQUIRED: [&str; 4] = ["specversion", "id", "source", "type"];
/// [`REQUIRED`] as the headers they are stored under.
const REQUIRED_HEADERS: [(&str, &str); 4] = [
    ("specversion", "ce-specversion"),
    ("id", "ce-id"),
    ("source", "ce-source"),
    ("type", "ce-type"),
];

fn check_required(name: &'static str, value: Option<&str>) -> Result<(), EventError> {
    match value {
        None => Err(EventError::invalid(name, "required attribute is missing")),
        Some("") => Err(EventError::invalid(name, "must not be empty")),
        Some(version) if name == "specversion" && version != SPEC_VERSION => {
            Err(EventError::invalid(
                name,
                format!(
                    "unsupported specversion `{version}`; eddy accepts 1.0 (and 0.3, stored as 1.0)"
                ),
            ))
        }
        Some(_) => Ok(()),
    }
}

/// The NATS subject an event is stored under; an error names the attribute at fault.
fn subject_of(source: &str, ty: &str) -> Result<String, EventError> {
    subject::event_subject(source, ty).map_err(|error| match error {
        subject::SubjectError::EmptySource => EventError::invalid("source", error.to_string()),
        _ => EventError::invalid("type", error.to_string()),
    })
}

fn finish(
    mut builder: HeaderBuilder,
    payload: Bytes,
    limits: &Limits,
) -> Result<OutgoingEvent, EventError> {
    if let Some(ty) = builder.headers.get("ce-type").map(str::to_owned) {
        set_original_type(&mut builder.headers, ty);
    }
    let size = builder.headers.encoded_size() + payload.len();
    if size > limits.max_event_size {
        return Err(EventError::too_large(size, limits.max_event_size));
    }
    // Subject, message id and identity come from the values stored (percent-decoded in binary
    // mode), so what is validated, routed and deduplicated is what subscribers receive.
    let attribute = |name: &'static str| {
        builder.headers.get(name).map(str::to_owned).ok_or_else(|| {
            EventError::invalid(
                &name[names::CE_PREFIX.len()..],
                "required attribute is missing",
            )
        })
    };
    let id = attribute("ce-id")?;
    let source = attribute("ce-source")?;
    let ty = attribute("ce-type")?;
    Ok(OutgoingEvent {
        subject: subject_of(&source, &ty)?,
        msg_id: message_id(&source, &id),
        headers: builder.headers,
        payload,
        id,
        source,
    })
}

/// Sets `originaltype` as Kyma's publisher proxy does (its `GenericBuilder`): to the type as
/// published, over any value the publisher gave. That proxy skips events whose type is
/// already in its legacy form (`sap.kyma.custom.…`); eddy sets it on every event, which is what
/// Kyma's eventing e2e suite checks of every delivered event (eddy never rewrites a type, so
/// `originaltype` is always the type delivered).
pub(crate) fn set_original_type(headers: &mut EventHeaders, ty: String) {
    headers.set(names::ORIGINAL_TYPE, ty);
}

/// The text of a binary-mode attribute header. The HTTP binding percent-encodes what is not
/// printable ASCII, and such a value is decoded. A value with bytes past ASCII was not encoded
/// (CloudEvents' Go SDK, and with it Kyma's publisher proxy, writes UTF-8 as it is and reads it
/// so): it is taken as the UTF-8 text it is, `%` included.
fn header_text<'a>(
    attribute: &str,
    value: &'a http::HeaderValue,
) -> Result<Cow<'a, str>, EventError> {
    if value.as_bytes().is_ascii() {
        return percent_encoding::percent_decode(value.as_bytes())
            .decode_utf8()
            .map_err(|_| {
                EventError::invalid(
                    attribute.to_owned(),
                    "value is not UTF-8 once percent-decoded",
                )
            });
    }
    std::str::from_utf8(value.as_bytes())
        .map(Cow::Borrowed)
        .map_err(|_| {
            EventError::invalid(
                attribute.to_owned(),
                "header value must be percent-encoded ASCII or UTF-8",
            )
        })
}

/// The CloudEvents version eddy stores.
const SPEC_VERSION: &str = "1.0";
/// The earlier version eddy reads and stores as 1.0, as CloudEvents' Go SDK converts it:
/// `schemaurl` becomes `dataschema`, a structured event's base64 `data`
/// (`datacontentencoding: base64`) becomes its data's bytes, other attributes stay.
const SPEC_VERSION_03: &str = "0.3";

/// 0.3's `schemaurl` may be relative; 1.0's `dataschema`, which it becomes, may not.
fn check_schemaurl(text: &str) -> Result<(), EventError> {
    url::Url::parse(text).map(drop).map_err(|error| {
        EventError::invalid(
            "schemaurl",
            format!("must be an absolute URI to be stored as 1.0's dataschema: {error}"),
        )
    })
}

/// A binary-mode event: attributes in `ce-*` headers, the body as data. Header values are
/// percent-decoded as the HTTP binding says, so JetStream holds the attribute values themselves;
/// typed attributes (time, dataschema) are checked as decoded, with the same parsers the
/// CloudEvents SDK uses (a second parse by the SDK cost a tenth of the event-bus's own work).
/// The body is stored untouched.
pub fn from_binary(
    headers: &http::HeaderMap,
    body: Bytes,
    limits: &Limits,
) -> Result<OutgoingEvent, EventError> {
    let mut builder = HeaderBuilder::new();
    let v03 = headers
        .get("ce-specversion")
        .is_some_and(|version| version.as_bytes() == SPEC_VERSION_03.as_bytes());
    for (name, value) in headers {
        let Some(attribute) = name.as_str().strip_prefix(names::CE_PREFIX) else {
            continue;
        };
        check_attribute_name(attribute)?;
        let decoded = header_text(attribute, value)?;
        check_text(attribute, &decoded)?;
        if v03 {
            match attribute {
                "specversion" => {
                    builder.insert(attribute, name.as_str().to_owned(), SPEC_VERSION)?;
                    continue;
                }
                "schemaurl" => {
                    check_schemaurl(&decoded)?;
                    builder.insert(attribute, "ce-dataschema", &decoded)?;
                    continue;
                }
                _ => {}
            }
        }
        check_typed_attribute(attribute, &decoded)?;
        builder.insert(attribute, name.as_str().to_owned(), &decoded)?;
    }
    for (required, header) in REQUIRED_HEADERS {
        check_required(required, builder.headers.get(header))?;
    }
    if let Some(content_type) = headers.get(http::header::CONTENT_TYPE) {
        let text = content_type
            .to_str()
            .map_err(|_| EventError::invalid("datacontenttype", "content-type must be ASCII"))?;
        builder.insert("datacontenttype", names::CONTENT_TYPE, text)?;
    }
    builder.insert_trace(&TraceContext::from_http(headers));
    finish(builder, body, limits)
}

/// One event sent over HTTP in binary or structured mode, `mode` being [`content_mode`] of the
/// headers. The event-bus's publish route and the dispatcher's replies both take this path, so
/// an event is stored the same, byte for byte, whichever way it came in.
pub fn from_single(
    mode: ContentMode,
    headers: &http::HeaderMap,
    body: Bytes,
    limits: &Limits,
) -> Result<OutgoingEvent, EventError> {
    match mode {
        ContentMode::Binary => from_binary(headers, body, limits),
        ContentMode::Structured => {
            from_structured(&body, &TraceContext::from_http(headers), limits)
        }
        ContentMode::Batch => Err(EventError::unsupported(
            "one event is expected here, not a batch",
        )),
    }
}

/// A structured-mode event: one JSON object.
pub fn from_structured(
    body: &[u8],
    trace: &TraceContext,
    limits: &Limits,
) -> Result<OutgoingEvent, EventError> {
    let raw: &RawValue = serde_json::from_slice(body)
        .map_err(|error| EventError::malformed(format!("body is not valid JSON: {error}")))?;
    from_raw(raw, trace, limits)
}

/// Largest raw JSON text of one structured event: its data may be base64 (4/3 of the bytes) and
/// its attributes sit beside it, so twice the stored size limit.
fn max_structured_size(limits: &Limits) -> usize {
    limits.max_event_size.saturating_mul(2)
}

/// The members of a JSON object, their values left as raw JSON text: reading costs what the text
/// weighs whatever its shape (8M small numbers in `data` build no value at all).
type RawMembers<'a> = IndexMap<String, &'a RawValue>;

/// A JSON value read without building it, good enough to check an attribute's type: compound
/// values (arrays, objects) become an empty object and are never parsed.
pub(crate) fn shallow(raw: &RawValue) -> Result<Value, serde_json::Error> {
    match raw.get().as_bytes().first() {
        Some(b'[' | b'{') => Ok(Value::Object(Map::new())),
        _ => serde_json::from_str(raw.get()),
    }
}

/// One event of structured or batch mode, as raw JSON text. The size is checked on the text
/// before anything is built; `data` is never parsed into values: JSON data is stored as sent.
pub fn from_raw(
    raw: &RawValue,
    trace: &TraceContext,
    limits: &Limits,
) -> Result<OutgoingEvent, EventError> {
    let text = raw.get();
    if text.len() > max_structured_size(limits) {
        return Err(EventError::too_large(
            text.len(),
            max_structured_size(limits),
        ));
    }
    if !text.starts_with('{') {
        return Err(EventError::malformed(
            "a structured event must be a JSON object",
        ));
    }
    let mut members: RawMembers<'_> = serde_json::from_str(text)
        .map_err(|error| EventError::malformed(format!("invalid CloudEvent: {error}")))?;
    let data = members.shift_remove("data");
    let mut map = Map::with_capacity(members.len());
    for (name, value) in members {
        let value = shallow(value)
            .map_err(|error| EventError::malformed(format!("invalid CloudEvent: {error}")))?;
        map.insert(name, value);
    }
    let mut data = data.filter(|data| data.get() != "null");
    if data.is_some() && map.get("data_base64").is_some_and(|v| !v.is_null()) {
        return Err(EventError::invalid(
            "data_base64",
            "an event has `data` or `data_base64`, not both",
        ));
    }
    check_structured(&mut map, &mut data)?;
    // The SDK checks the attributes (and decodes `data_base64`); `data` stays out of it.
    let mut event: Event =
        serde_json::from_value(Value::Object(map)).map_err(|error| sdk_json_error(&error))?;

    let mut builder = HeaderBuilder::new();
    for (name, value) in event.iter() {
        let text = match value {
            // Canonical RFC 3339 with `Z`, as the JSON format writes it.
            AttributeValue::Time(time) => time.to_rfc3339_opts(SecondsFormat::AutoSi, true),
            other => other.to_string(),
        };
        if name == "datacontenttype" {
            builder.insert(name, names::CONTENT_TYPE, &text)?;
            continue;
        }
        let mut header_name = String::with_capacity(names::CE_PREFIX.len() + name.len());
        header_name.push_str(names::CE_PREFIX);
        header_name.push_str(name);
        builder.insert(name, header_name, &text)?;
    }
    builder.insert_trace(trace);

    let content_type_given = event.datacontenttype().is_some();
    let is_json = event.datacontenttype().is_none_or(is_json_content_type);
    let payload = match (data, event.take_data().2) {
        (Some(data), _) if is_json => {
            if !content_type_given {
                builder.insert("datacontenttype", names::CONTENT_TYPE, "application/json")?;
            }
            Bytes::copy_from_slice(data.get().as_bytes())
        }
        (Some(data), _) => match serde_json::from_str::<String>(data.get()) {
            Ok(text) => Bytes::from(text),
            Err(_) => {
                return Err(EventError::invalid(
                    "data",
                    "data of a non-JSON content type must be a string (or use data_base64)",
                ));
            }
        },
        (None, None) => Bytes::new(),
        (None, Some(Data::Binary(bytes))) => Bytes::from(bytes),
        (None, Some(Data::String(text))) => Bytes::from(text),
        (None, Some(Data::Json(json))) => Bytes::from(
            serde_json::to_vec(&json).map_err(|e| EventError::invalid("data", e.to_string()))?,
        ),
    };
    finish(builder, payload, limits)
}

/// The SDK's test for JSON data (`application/json`, `text/json`, `+json`), on the media type.
fn is_json_content_type(content_type: &str) -> bool {
    let media_type = content_type.split(';').next().unwrap_or_default().trim();
    media_type.eq_ignore_ascii_case("application/json")
        || media_type.eq_ignore_ascii_case("text/json")
        || media_type.to_ascii_lowercase().ends_with("+json")
}

/// Checks names and value types of a structured event before the SDK sees it. JSON `null`
/// attributes count as absent, as the JSON event format says.
fn check_structured(
    map: &mut Map<String, Value>,
    data: &mut Option<&RawValue>,
) -> Result<(), EventError> {
    map.retain(|_, value| !value.is_null());
    if map.get("specversion").and_then(Value::as_str) == Some(SPEC_VERSION_03) {
        upgrade_v03(map, data)?;
    }
    // `data` was taken out by `from_raw` (which refuses it beside `data_base64`).
    for (name, value) in map.iter() {
        if name == "data_base64" {
            continue;
        }
        check_attribute_name(name)?;
        let is_extension = !matches!(
            name.as_str(),
            "specversion"
                | "id"
                | "source"
                | "type"
                | "subject"
                | "time"
                | "datacontenttype"
                | "dataschema"
        );
        match value {
            Value::String(text) => {
                check_text(name, text)?;
                check_typed_attribute(name, text)?;
            }
            Value::Bool(_) if is_extension => {}
            Value::Number(number) if is_extension => {
                let in_range = number.as_i64().is_some_and(|n| i32::try_from(n).is_ok());
                if !in_range {
                    return Err(EventError::invalid(
                        name.clone(),
                        "integer extension values must be whole numbers within 32 bits",
                    ));
                }
            }
            _ if is_extension => {
                return Err(EventError::invalid(
                    name.clone(),
                    "extension values must be strings, booleans or integers",
                ));
            }
            _ => return Err(EventError::invalid(name.clone(), "must be a string")),
        }
    }
    for required in REQUIRED {
        check_required(required, map.get(required).and_then(Value::as_str))?;
    }
    Ok(())
}

/// A 0.3 structured event as 1.0 (see [`SPEC_VERSION_03`]).
fn upgrade_v03(
    map: &mut Map<String, Value>,
    data: &mut Option<&RawValue>,
) -> Result<(), EventError> {
    map.insert("specversion".to_owned(), Value::from(SPEC_VERSION));
    if let Some(schemaurl) = map.remove("schemaurl") {
        let text = schemaurl
            .as_str()
            .ok_or_else(|| EventError::invalid("schemaurl", "must be a string"))?;
        check_schemaurl(text)?;
        map.insert("dataschema".to_owned(), schemaurl);
    }
    match map.remove("datacontentencoding") {
        None => {}
        Some(Value::String(encoding)) if encoding.eq_ignore_ascii_case("base64") => {
            let text = data
                .take()
                .map(|raw| serde_json::from_str::<String>(raw.get()))
                .transpose()
                .ok()
                .flatten()
                .ok_or_else(|| {
                    EventError::invalid(
                        "data",
                        "with datacontentencoding base64, data must be a base64 string",
                    )
                })?;
            map.insert("data_base64".to_owned(), Value::String(text));
        }
        Some(_) => {
            return Err(EventError::invalid(
                "datacontentencoding",
                "the only encoding CloudEvents 0.3 defines is base64",
            ));
        }
    }
    Ok(())
}

/// Time and dataschema have types of their own; check them here to name them in the error.
fn check_typed_attribute(name: &str, text: &str) -> Result<(), EventError> {
    match name {
        "time" => chrono::DateTime::parse_from_rfc3339(text)
            .map(drop)
            .map_err(|error| {
                EventError::invalid("time", format!("not an RFC 3339 timestamp: {error}"))
            }),
        "dataschema" => url::Url::parse(text).map(drop).map_err(|error| {
            EventError::invalid("dataschema", format!("not an absolute URI: {error}"))
        }),
        _ => Ok(()),
    }
}

fn sdk_json_error(error: &serde_json::Error) -> EventError {
    // Names, types, time and dataschema were checked before; what is left is the data.
    let text = error.to_string();
    if text.contains("decode error") {
        return EventError::invalid("data_base64", format!("not valid base64 ({text})"));
    }
    EventError::malformed(format!("invalid CloudEvent: {text}"))
}

/// A batch: a JSON array of structured events. Either every event is valid and the list is
/// returned, or the errors are returned per position and nothing is stored. The array is read
/// one level deep and stops at the event count limit, so neither many tiny entries nor one
/// deeply shaped event costs more than its bytes.
pub fn from_batch(
    body: &[u8],
    trace: &TraceContext,
    limits: &Limits,
) -> Result<Vec<OutgoingEvent>, BatchError> {
    let starts_as_array = body
        .iter()
        .find(|byte| !byte.is_ascii_whitespace())
        .is_some_and(|byte| *byte == b'[');
    if !starts_as_array {
        // Still say "not JSON" when it is not.
        if let Err(error) = serde_json::from_slice::<&RawValue>(body) {
            return Err(BatchError::Whole(EventError::malformed(format!(
                "body is not valid JSON: {error}"
            ))));
        }
        return Err(BatchError::Whole(EventError::malformed(
            "a batch must be a JSON array of events",
        )));
    }
    let too_many = std::cell::Cell::new(false);
    let mut reader = serde_json::Deserializer::from_slice(body);
    let items = BoundedArray {
        limit: limits.max_batch_events,
        too_many: &too_many,
    }
    .deserialize(&mut reader)
    .and_then(|items| reader.end().map(|()| items));
    let items = match items {
        Ok(items) => items,
        Err(_) if too_many.get() => {
            return Err(BatchError::Whole(EventError::too_many_events(
                limits.max_batch_events,
            )));
        }
        Err(error) => {
            return Err(BatchError::Whole(EventError::malformed(format!(
                "body is not valid JSON: {error}"
            ))));
        }
    };
    let results: Vec<Result<OutgoingEvent, EventError>> = items
        .into_iter()
        .map(|item| from_raw(item, trace, limits))
        .collect();
    if results.iter().all(Result::is_ok) {
        Ok(results.into_iter().flatten().collect())
    } else {
        Err(BatchError::PerEvent(
            results.into_iter().map(|result| result.err()).collect(),
        ))
    }
}

/// Reads a JSON array into raw entries, failing (and saying so) past `limit` entries.
struct BoundedArray<'c> {
    limit: usize,
    too_many: &'c std::cell::Cell<bool>,
}

impl<'de> DeserializeSeed<'de> for BoundedArray<'_> {
    type Value = Vec<&'de RawValue>;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for BoundedArray<'_> {
    type Value = Vec<&'de RawValue>;

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("a JSON array of events")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.limit));
        while let Some(item) = seq.next_element::<&'de RawValue>()? {
            if items.len() == self.limit {
                self.too_many.set(true);
                return Err(serde::de::Error::custom("too many events"));
            }
            items.push(item);
        }
        Ok(items)
    }
}

/// Why a batch was refused.
#[derive(Debug)]
pub enum BatchError {
    /// The batch as a whole (not JSON, not an array, too many events).
    Whole(EventError),
    /// One entry per event: `None` for a valid event, the error otherwise.
    PerEvent(Vec<Option<EventError>>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMITS: Limits = Limits {
        max_event_size: 1 << 20,
        max_batch_events: 100,
    };

    fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
        let mut map = http::HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                http::HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    #[test]
    fn content_modes() {
        let mode = |pairs: &[(&str, &str)]| content_mode(&headers(pairs));
        assert_eq!(mode(&[("ce-specversion", "1.0")]), Ok(ContentMode::Binary));
        assert_eq!(
            mode(&[(
                "content-type",
                "Application/CloudEvents+JSON; charset=utf-8"
            )]),
            Ok(ContentMode::Structured)
        );
        assert_eq!(
            mode(&[("content-type", "application/cloudevents-batch+json")]),
            Ok(ContentMode::Batch)
        );
        assert_eq!(
            mode(&[
                ("content-type", "application/json"),
                ("ce-specversion", "1.0")
            ]),
            Ok(ContentMode::Binary)
        );
        assert_eq!(
            mode(&[("content-type", "application/json")])
                .unwrap_err()
                .refusal,
            Refusal::Unsupported
        );
        assert_eq!(
            mode(&[("content-type", "application/cloudevents+avro")])
                .unwrap_err()
                .refusal,
            Refusal::Unsupported
        );
    }

    #[test]
    fn binary_values_are_percent_decoded() {
        let event = from_binary(
            &headers(&[
                ("ce-specversion", "1.0"),
                ("ce-id", "1"),
                ("ce-source", "s"),
                ("ce-type", "t"),
                ("ce-subject", "a%20b%25c%C3%BC"),
            ]),
            Bytes::from_static(b"x"),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(event.headers.get("ce-subject"), Some("a b%cü"));
        let error = from_binary(
            &headers(&[
                ("ce-specversion", "1.0"),
                ("ce-id", "1%0A"),
                ("ce-source", "s"),
                ("ce-type", "t"),
            ]),
            Bytes::new(),
            &LIMITS,
        )
        .unwrap_err();
        assert_eq!(error.field.as_deref(), Some("id"));
        // Typed attributes are checked as decoded.
        let required = [
            ("ce-specversion", "1.0"),
            ("ce-id", "1"),
            ("ce-source", "s"),
            ("ce-type", "t"),
        ];
        let with = |name: &'static str, value: &[u8]| {
            let mut headers = headers(&required);
            headers.insert(name, http::HeaderValue::from_bytes(value).unwrap());
            from_binary(&headers, Bytes::new(), &LIMITS)
        };
        let event = with("ce-time", b"2026-11-25T10%3A00%3A00Z").unwrap();
        assert_eq!(event.headers.get("ce-time"), Some("2026-11-25T10:00:00Z"));
        for (name, value, field) in [
            ("ce-time", &b"2026-11-25T10%3A00"[..], "time"),
            ("ce-dataschema", b"not a uri", "dataschema"),
        ] {
            let error = with(name, value).unwrap_err();
            assert_eq!(error.field.as_deref(), Some(field), "{error:?}");
        }
    }

    /// Kyma's publisher proxy (`GenericBuilder.Build`): "ceEvent.SetExtension(
    /// OriginalTypeHeaderName, event.Type())", `originaltype` over whatever the publisher set;
    /// Kyma's eventing e2e suite checks every delivered event for it, equal to the type.
    #[test]
    fn every_event_carries_its_type_as_originaltype() {
        let binary = from_binary(
            &headers(&[
                ("ce-specversion", "1.0"),
                ("ce-id", "1"),
                ("ce-source", "s"),
                ("ce-type", "order.created.v1"),
                ("ce-originaltype", "forged"),
            ]),
            Bytes::new(),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(
            binary.headers.get(names::ORIGINAL_TYPE),
            Some("order.created.v1")
        );
        let structured = from_structured(
            br#"{"specversion":"1.0","id":"1","source":"s","type":"Order-$.third.R-e-c-e-i-v-e-d.v1"}"#,
            &TraceContext::default(),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(
            structured.headers.get(names::ORIGINAL_TYPE),
            Some("Order-$.third.R-e-c-e-i-v-e-d.v1")
        );
        // Kyma's legacy form too: Kyma's e2e suite publishes it to exact Subscriptions and
        // checks "expected originaltype header to have value" equal to the type.
        let legacy_form = from_structured(
            br#"{"specversion":"1.0","id":"1","source":"s","type":"sap.kyma.custom.app.order.created.v1"}"#,
            &TraceContext::default(),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(
            legacy_form.headers.get(names::ORIGINAL_TYPE),
            Some("sap.kyma.custom.app.order.created.v1")
        );
    }

    /// CloudEvents' Go SDK (so Kyma's publisher proxy) writes and reads binary-mode values as
    /// they are, UTF-8 included: such a value is stored unchanged, `%` included; a value in
    /// ASCII is percent-decoded as the HTTP binding says.
    #[test]
    fn raw_utf8_header_values_are_stored_as_they_are() {
        let mut map = headers(&[
            ("ce-specversion", "1.0"),
            ("ce-id", "1"),
            ("ce-source", "s"),
        ]);
        map.insert(
            "ce-type",
            http::HeaderValue::from_bytes("commande.créée.v1".as_bytes()).unwrap(),
        );
        map.insert(
            "ce-subject",
            http::HeaderValue::from_bytes("100% über".as_bytes()).unwrap(),
        );
        let event = from_binary(&map, Bytes::new(), &LIMITS).unwrap();
        assert_eq!(event.headers.get("ce-type"), Some("commande.créée.v1"));
        assert_eq!(event.headers.get("ce-subject"), Some("100% über"));
        event.check_invariants(&LIMITS).unwrap();
        // Bytes that are not UTF-8 are refused, naming the attribute.
        map.insert(
            "ce-subject",
            http::HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
        );
        let error = from_binary(&map, Bytes::new(), &LIMITS).unwrap_err();
        assert_eq!(error.field.as_deref(), Some("subject"), "{error:?}");
    }

    /// CloudEvents 0.3, which Kyma's publisher proxy (sdk-go) reads, is stored as 1.0 the way
    /// sdk-go's `EventContextV03.AsV1` converts it: "ret.DataSchema = &types.URI{URL:
    /// ec.SchemaURL.URL}", other attributes kept; a 0.3 structured event's base64 data
    /// (`datacontentencoding: base64`) becomes its bytes.
    #[test]
    fn specversion_0_3_is_stored_as_1_0() {
        let binary = from_binary(
            &headers(&[
                ("ce-specversion", "0.3"),
                ("ce-id", "1"),
                ("ce-source", "s"),
                ("ce-type", "t"),
                ("ce-schemaurl", "https://example.com/schema"),
            ]),
            Bytes::from_static(b"x"),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(binary.headers.get("ce-specversion"), Some("1.0"));
        assert_eq!(
            binary.headers.get("ce-dataschema"),
            Some("https://example.com/schema")
        );
        assert_eq!(binary.headers.get("ce-schemaurl"), None);
        let structured = from_structured(
            br#"{"specversion":"0.3","id":"1","source":"s","type":"t",
                 "schemaurl":"https://example.com/schema","datacontenttype":"text/plain",
                 "datacontentencoding":"base64","data":"aGVsbG8="}"#,
            &TraceContext::default(),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(structured.headers.get("ce-specversion"), Some("1.0"));
        assert_eq!(
            structured.headers.get("ce-dataschema"),
            Some("https://example.com/schema")
        );
        assert_eq!(&structured.payload[..], b"hello");
        structured.check_invariants(&LIMITS).unwrap();
        // 0.3's schemaurl may be relative, 1.0's dataschema not: refused, naming it.
        let error = from_structured(
            br#"{"specversion":"0.3","id":"1","source":"s","type":"t","schemaurl":"/schema"}"#,
            &TraceContext::default(),
            &LIMITS,
        )
        .unwrap_err();
        assert_eq!(error.field.as_deref(), Some("schemaurl"), "{error:?}");
        let error = from_structured(
            br#"{"specversion":"0.2","id":"1","source":"s","type":"t"}"#,
            &TraceContext::default(),
            &LIMITS,
        )
        .unwrap_err();
        assert_eq!(error.field.as_deref(), Some("specversion"), "{error:?}");
    }

    #[test]
    fn repeated_attributes_are_refused() {
        let error = from_binary(
            &headers(&[
                ("ce-specversion", "1.0"),
                ("ce-id", "1"),
                ("ce-id", "2"),
                ("ce-source", "s"),
                ("ce-type", "t"),
            ]),
            Bytes::new(),
            &LIMITS,
        )
        .unwrap_err();
        assert_eq!(error.field.as_deref(), Some("id"));
    }

    #[test]
    fn the_size_limit_counts_headers_and_data() {
        let limits = Limits {
            max_event_size: 200,
            max_batch_events: 1,
        };
        let pairs = [
            ("ce-specversion", "1.0"),
            ("ce-id", "1"),
            ("ce-source", "s"),
            ("ce-type", "t"),
        ];
        assert!(from_binary(&headers(&pairs), Bytes::from(vec![b'x'; 100]), &limits).is_ok());
        let error =
            from_binary(&headers(&pairs), Bytes::from(vec![b'x'; 190]), &limits).unwrap_err();
        assert_eq!(error.refusal, Refusal::TooLarge);
    }

    proptest! {
        #[test]
        fn structured_parsing_never_panics(body in any::<Vec<u8>>()) {
            if let Ok(event) = from_structured(&body, &TraceContext::default(), &LIMITS) {
                prop_assert_eq!(event.check_invariants(&LIMITS), Ok(()));
            }
            if let Ok(events) = from_batch(&body, &TraceContext::default(), &LIMITS) {
                for event in events {
                    prop_assert_eq!(event.check_invariants(&LIMITS), Ok(()));
                }
            }
        }

        #[test]
        fn structured_attributes_never_panic(
            key in prop_oneof!["[a-zA-Z0-9_-]{0,8}", "[a-z0-9]{1,8}"],
            // Anything, and often a control character inside otherwise plain text.
            value in prop_oneof![any::<String>(), "[ -~]{0,6}[\\x00-\\x1f\\x7f\\u{80}-\\u{9f}][ -~]{0,6}"],
            ty in prop_oneof![any::<String>(), "[a-z.]{1,12}"],
            source in prop_oneof![any::<String>(), "[a-z/:.]{1,12}"],
        ) {
            let event = serde_json::json!({"specversion": "1.0", "id": "1", "source": source, "type": ty, key: value});
            if let Ok(event) = from_structured(event.to_string().as_bytes(), &TraceContext::default(), &LIMITS) {
                prop_assert_eq!(event.check_invariants(&LIMITS), Ok(()));
            }
        }

        #[test]
        fn binary_parsing_never_panics(
            // Printable text, and percent-escapes of control characters inside it.
            values in prop::collection::vec("([ -~]|%0[0-9a-f]|%1[0-9a-f]|%7[fF]|%C2%8[0-9]){0,12}", 4),
            extension in "[a-z0-9-]{1,6}",
        ) {
            // A valid spec version most of the time, so the other values get parsed.
            let specversion = if values[0].len() % 4 == 0 { values[0].as_str() } else { "1.0" };
            let map = headers(&[
                ("ce-specversion", specversion),
                ("ce-id", &values[1]),
                ("ce-source", &values[2]),
                ("ce-type", &values[3]),
                (&format!("ce-{extension}"), &values[0]),
            ]);
            if let Ok(event) = from_binary(&map, Bytes::new(), &LIMITS) {
                prop_assert_eq!(event.check_invariants(&LIMITS), Ok(()));
            }
        }
    }
}
