//! The legacy JSON format (`POST /{application}/v1/events`), kept so that publishers written for
//! Kyma's legacy event API move over unchanged.
//!
//! ```json
//! {"event-type": "order.created", "event-type-version": "v1", "event-id": "optional",
//!  "event-time": "2024-01-01T00:00:00Z", "data": {...}}
//! ```
//! becomes a CloudEvent with source = application, type = `order.created.v1`.

use std::borrow::Cow;

use bytes::Bytes;
use indexmap::IndexMap;
use serde::Serialize;
use serde_json::{Map, Value, value::RawValue};

use crate::{
    event::{EventHeaders, Limits, OutgoingEvent, shallow},
    headers as names,
    subject::{self, message_id},
};

/// One problem with a legacy event, in the shape Kyma's legacy API answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LegacyFieldError {
    /// The field at fault.
    pub field: &'static str,
    /// `missing_field`, `invalid_field` or `too_large`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// A sentence for the publisher.
    pub message: String,
}

impl LegacyFieldError {
    fn missing(field: &'static str) -> Self {
        Self {
            field,
            kind: "missing_field",
            message: format!("`{field}` is required"),
        }
    }

    fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self {
            field,
            kind: "invalid_field",
            message: message.into(),
        }
    }
}

fn text_field<'a>(
    map: &'a Map<String, Value>,
    field: &'static str,
    errors: &mut Vec<LegacyFieldError>,
) -> Option<&'a str> {
    match map.get(field) {
        None | Some(Value::Null) => {
            errors.push(LegacyFieldError::missing(field));
            None
        }
        Some(Value::String(text)) if text.is_empty() => {
            errors.push(LegacyFieldError::invalid(
                field,
                format!("`{field}` must not be empty"),
            ));
            None
        }
        Some(Value::String(text)) if text.chars().any(char::is_control) => {
            errors.push(LegacyFieldError::invalid(
                field,
                format!("`{field}` must not contain control characters"),
            ));
            None
        }
        Some(Value::String(text)) => Some(text),
        Some(_) => {
            errors.push(LegacyFieldError::invalid(
                field,
                format!("`{field}` must be a string"),
            ));
            None
        }
    }
}

/// Parses and validates a legacy event for `application`. `new_id` supplies an id when the
/// publisher gave none. All problems are reported at once.
pub fn from_legacy(
    application: &str,
    body: &[u8],
    limits: &Limits,
    new_id: impl FnOnce() -> String,
) -> Result<OutgoingEvent, Vec<LegacyFieldError>> {
    let not_json = |error: serde_json::Error| {
        vec![LegacyFieldError::invalid(
            "body",
            format!("body is not valid JSON: {error}"),
        )]
    };
    let raw: &RawValue = serde_json::from_slice(body).map_err(not_json)?;
    if !raw.get().starts_with('{') {
        return Err(vec![LegacyFieldError::invalid(
            "body",
            "body must be a JSON object",
        )]);
    }
    // One level deep: `data` stays raw JSON text (stored as sent), so parsing costs what the
    // body weighs whatever its shape.
    let mut members: IndexMap<String, &RawValue> =
        serde_json::from_str(raw.get()).map_err(not_json)?;
    let data = members
        .shift_remove("data")
        .filter(|data| data.get() != "null");
    let mut map = Map::with_capacity(members.len());
    for (name, value) in members {
        map.insert(name, shallow(value).map_err(not_json)?);
    }
    let mut errors = Vec::new();
    let event_type = text_field(&map, "event-type", &mut errors);
    let version = text_field(&map, "event-type-version", &mut errors);
    let time = text_field(&map, "event-time", &mut errors);
    let id = match map.get("event-id") {
        None | Some(Value::Null) => None,
        Some(_) => text_field(&map, "event-id", &mut errors),
    };
    if let Some(version) = version
        && !version.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        errors.push(LegacyFieldError::invalid(
            "event-type-version",
            "`event-type-version` must consist of letters and digits",
        ));
    }
    if let Some(time) = time
        && let Err(error) = chrono::DateTime::parse_from_rfc3339(time)
    {
        errors.push(LegacyFieldError::invalid(
            "event-time",
            format!("`event-time` is not an RFC 3339 timestamp: {error}"),
        ));
    }
    if data.is_none() {
        errors.push(LegacyFieldError::missing("data"));
    }
    if application.is_empty() || application.chars().any(char::is_control) {
        errors.push(LegacyFieldError::invalid(
            "application",
            "the application name in the path is invalid",
        ));
    }
    let (Some(event_type), Some(version), Some(time), Some(data), true) =
        (event_type, version, time, data, errors.is_empty())
    else {
        return Err(errors);
    };

    let ty = format!("{event_type}.{version}");
    let subject = subject::event_subject(application, &ty)
        .map_err(|error| vec![LegacyFieldError::invalid("event-type", error.to_string())])?;
    let id = id.map_or_else(new_id, str::to_owned);
    let payload = Bytes::copy_from_slice(data.get().as_bytes());

    let mut headers = EventHeaders::default();
    for (name, value) in [
        ("ce-specversion", "1.0"),
        ("ce-id", id.as_str()),
        ("ce-source", application),
        ("ce-type", ty.as_str()),
        ("ce-time", time),
        (names::CONTENT_TYPE, "application/json"),
        // As Kyma's legacy conversion sets it.
        (names::EVENT_TYPE_VERSION, version),
    ] {
        // Every value was checked for control characters above; check rather than assume.
        if value.contains(['\r', '\n']) {
            return Err(vec![LegacyFieldError::invalid(
                "body",
                "a value contains control characters",
            )]);
        }
        headers.push(Cow::Borrowed(name), value.to_owned());
    }
    crate::event::set_original_type(&mut headers, ty.clone());
    // Counted as the other modes count it: the NATS header preamble, each header, the data.
    let size = headers.encoded_size() + payload.len();
    if size > limits.max_event_size {
        return Err(vec![LegacyFieldError {
            field: "data",
            kind: "too_large",
            message: format!(
                "event is {size} bytes, the limit is {} bytes",
                limits.max_event_size
            ),
        }]);
    }
    Ok(OutgoingEvent {
        subject,
        msg_id: message_id(application, &id),
        headers,
        payload,
        id,
        source: application.to_owned(),
    })
}

/// Kyma eventing's default `eventTypePrefix`: an exact-matching Subscription names an
/// application's event as `<prefix>.<application>.<event>.<version>`.
pub const KYMA_EVENT_TYPE_PREFIX: &str = "sap.kyma.custom";

/// Header of a legacy event's copy in Kyma's legacy form ([`kyma_form`]): the subject of the
/// event it copies. The dispatcher delivers the copy only to a Subscription that does not
/// also take that subject, so no Subscription gets one legacy event twice.
pub const KYMA_FORM_OF: &str = "eddy-kyma-form-of";

/// The copy of a legacy event that Kyma's publisher proxy also publishes (its JetStream
/// sender, `WriteLegacyRequestsToCE`): the type `sap.kyma.custom.<app>.<event>.<version>`, with
/// the application cleaned to letters and digits and the event name to two segments
/// (`Account.Order.Created` becomes `AccountOrder.Created`, characters other than letters,
/// digits and dots removed), so exact Subscriptions written for Kyma's legacy form receive it.
/// It keeps the event's id, source, time, data and `eventtypeversion`; its `originaltype` is
/// its own type (what Kyma's eventing e2e suite checks), [`KYMA_FORM_OF`] names `event`'s
/// subject, and its message id is its own (JetStream would take it for a repeat of `event`).
/// `None` when cleaning leaves an empty segment, where Kyma's proxy would refuse the event.
pub fn kyma_form(application: &str, event: &OutgoingEvent) -> Option<OutgoingEvent> {
    let version = event.headers.get(names::EVENT_TYPE_VERSION)?;
    let event_type = event
        .headers
        .get("ce-type")?
        .strip_suffix(version)?
        .strip_suffix('.')?;
    let clean_application: String = application
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let clean_event: String = event_type
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '.')
        .collect();
    let (object, operation) = match clean_event.rsplit_once('.') {
        Some((object, operation)) => (object.replace('.', ""), operation),
        None => (String::new(), clean_event.as_str()),
    };
    let mut ty = format!("{KYMA_EVENT_TYPE_PREFIX}.{clean_application}.");
    if clean_event.contains('.') {
        ty.push_str(&object);
        ty.push('.');
    }
    ty.push_str(operation);
    ty.push('.');
    ty.push_str(version);
    let subject = subject::event_subject(application, &ty).ok()?;
    let mut headers = EventHeaders::default();
    for (name, value) in event.headers.iter() {
        let value = match name {
            "ce-type" | names::ORIGINAL_TYPE => ty.clone(),
            _ => value.to_owned(),
        };
        headers.push(Cow::Owned(name.to_owned()), value);
    }
    headers.set(KYMA_FORM_OF, event.subject.clone());
    Some(OutgoingEvent {
        subject,
        // A source no event can have (a newline), so the id never meets a real event's.
        msg_id: message_id(
            &format!("{KYMA_EVENT_TYPE_PREFIX}\n{application}"),
            &event.id,
        ),
        headers,
        payload: event.payload.clone(),
        id: event.id.clone(),
        source: event.source.clone(),
    })
}

/// One event type subscribed for an application, as Kyma's publisher proxy lists it under
/// `GET /{application}/v1/events/subscribed`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct SubscribedEvent {
    /// The type without its version (`order.created`).
    pub name: String,
    /// The last segment of the type (`v1`).
    pub version: String,
}

/// The events subscribed for `application`, from the filter subjects of the Subscriptions'
/// consumers, as Kyma's publisher proxy finds them: under standard matching every type of a
/// Subscription whose source is the application; under exact matching (any source) the types
/// `sap.kyma.custom.<application>.` begins, without that prefix. Each once, sorted. Pure.
pub fn subscribed_events(application: &str, filter_subjects: &[String]) -> Vec<SubscribedEvent> {
    let exact_prefix = format!("{KYMA_EVENT_TYPE_PREFIX}.{application}.");
    let mut events: Vec<SubscribedEvent> = filter_subjects
        .iter()
        .filter_map(|subject| {
            let rest = subject
                .strip_prefix(crate::subject::EVENTS_SUBJECT_PREFIX)?
                .strip_prefix('.')?;
            let (source, type_tokens) = rest.split_once('.')?;
            let mut ty = String::new();
            for token in type_tokens.split('.') {
                if token == "*" || token == ">" {
                    return None;
                }
                if !ty.is_empty() {
                    ty.push('.');
                }
                ty.push_str(&crate::subject::unescape_token(token)?);
            }
            let ty = if source == "*" {
                ty.strip_prefix(&exact_prefix)?.to_owned()
            } else if crate::subject::unescape_token(source)? == application {
                ty
            } else {
                return None;
            };
            let (name, version) = ty.rsplit_once('.').unwrap_or((ty.as_str(), ""));
            Some(SubscribedEvent {
                name: name.to_owned(),
                version: version.to_owned(),
            })
        })
        .collect();
    events.sort();
    events.dedup();
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_event_size: 1 << 20,
        max_batch_events: 10,
    };

    fn parse(body: &str) -> Result<OutgoingEvent, Vec<LegacyFieldError>> {
        from_legacy("shop", body.as_bytes(), &LIMITS, || "generated".to_owned())
    }

    #[test]
    fn maps_to_a_cloudevent() {
        let event = parse(
            r#"{"event-type":"order.created","event-type-version":"v1","event-id":"e1",
                "event-time":"2024-01-01T00:00:00Z","data":{"b":1,"a":2}}"#,
        )
        .unwrap();
        assert_eq!(event.subject, "eddy.events.shop.order.created.v1");
        assert_eq!(event.id, "e1");
        assert_eq!(event.headers.get("ce-type").unwrap(), "order.created.v1");
        assert_eq!(event.headers.get("ce-source").unwrap(), "shop");
        assert_eq!(
            event.headers.get("ce-time").unwrap(),
            "2024-01-01T00:00:00Z"
        );
        assert_eq!(&event.payload[..], br#"{"b":1,"a":2}"#);
        assert_eq!(event.msg_id, message_id("shop", "e1"));
        // Kyma's legacy conversion: "event.SetExtension(eventTypeVersionExtensionKey,
        // eventTypeVersion)"; its publisher proxy's builder then sets `originaltype`.
        assert_eq!(event.headers.get("ce-eventtypeversion"), Some("v1"));
        assert_eq!(
            event.headers.get("ce-originaltype"),
            Some("order.created.v1")
        );
        event.check_invariants(&LIMITS).unwrap();
    }

    /// Kyma's publisher proxy publishes a legacy event a second time, in the legacy form
    /// (`convertPublishRequestToCloudEvent`: "eventName :=
    /// combineEventNameSegments(removeNonAlphanumeric(...EventType))", the application cleaned
    /// by `GetCleanName`), which Kyma's e2e suite's exact Subscriptions
    /// (`sap.kyma.custom.commerce.order.created.v1`) receive.
    #[test]
    fn the_kyma_form_is_kymas_legacy_type() {
        let form = |application: &str, event_type: &str| {
            let body = format!(
                r#"{{"event-type":"{event_type}","event-type-version":"v1","event-id":"e1",
                    "event-time":"2024-01-01T00:00:00Z","data":{{"a":1}}}}"#
            );
            let event =
                from_legacy(application, body.as_bytes(), &LIMITS, || "x".to_owned()).unwrap();
            kyma_form(application, &event).map(|copy| (event, copy))
        };
        let (event, copy) = form("commerce", "order.created").unwrap();
        assert_eq!(
            copy.headers.get("ce-type"),
            Some("sap.kyma.custom.commerce.order.created.v1")
        );
        assert_eq!(
            copy.headers.get("ce-originaltype"),
            Some("sap.kyma.custom.commerce.order.created.v1")
        );
        assert_eq!(
            copy.subject,
            "eddy.events.commerce.sap.kyma.custom.commerce.order.created.v1"
        );
        assert_eq!(copy.headers.get(KYMA_FORM_OF), Some(event.subject.as_str()));
        assert_eq!(copy.headers.get("ce-id"), Some("e1"));
        assert_eq!(copy.headers.get("ce-source"), Some("commerce"));
        assert_eq!(copy.headers.get("ce-eventtypeversion"), Some("v1"));
        assert_eq!(copy.payload, event.payload);
        assert_ne!(copy.msg_id, event.msg_id);
        let (_, copy) = form("my-app", "Account.Order-Item.Created").unwrap();
        assert_eq!(
            copy.headers.get("ce-type"),
            Some("sap.kyma.custom.myapp.AccountOrderItem.Created.v1")
        );
        let (_, copy) = form("app", "created").unwrap();
        assert_eq!(
            copy.headers.get("ce-type"),
            Some("sap.kyma.custom.app.created.v1")
        );
        // Nothing left of the application: no legacy form.
        assert!(form("--", "order.created").is_none());
    }

    #[test]
    fn generates_an_id_when_missing() {
        let event = parse(
            r#"{"event-type":"a","event-type-version":"v1","event-time":"2024-01-01T00:00:00Z","data":1}"#,
        )
        .unwrap();
        assert_eq!(event.id, "generated");
    }

    #[test]
    fn names_every_bad_field() {
        let errors = parse(r#"{"event-type-version":"v-1","event-time":"yesterday"}"#).unwrap_err();
        let fields: Vec<_> = errors.iter().map(|e| (e.field, e.kind)).collect();
        assert_eq!(
            fields,
            vec![
                ("event-type", "missing_field"),
                ("event-type-version", "invalid_field"),
                ("event-time", "invalid_field"),
                ("data", "missing_field"),
            ]
        );
    }

    #[test]
    fn refuses_empty_type_segments_and_non_objects() {
        let errors = parse(
            r#"{"event-type":"a..b","event-type-version":"v1","event-time":"2024-01-01T00:00:00Z","data":1}"#,
        )
        .unwrap_err();
        assert_eq!(errors[0].field, "event-type");
        assert_eq!(parse("[1]").unwrap_err()[0].field, "body");
        assert_eq!(parse("{").unwrap_err()[0].field, "body");
    }

    #[test]
    fn subscribed_events_are_listed_as_kymas_publisher_proxy_lists_them() {
        let subject = |source: &str, ty: &str| crate::subject::event_subject(source, ty).unwrap();
        let subjects = vec![
            subject("shop", "order.created.v1"),
            subject("shop", "order.created.v1"),
            subject("shop", "order.paid.v2"),
            subject("billing", "invoice.sent.v1"),
            "eddy.events.*.sap.kyma.custom.shop.cart.emptied.v1".to_owned(),
            "eddy.events.*.sap.kyma.custom.billing.x.v1".to_owned(),
            "eddy.events.shop.order.>".to_owned(),
            "eddy.dlq.default.x".to_owned(),
        ];
        assert_eq!(
            subscribed_events("shop", &subjects),
            vec![
                SubscribedEvent {
                    name: "cart.emptied".into(),
                    version: "v1".into()
                },
                SubscribedEvent {
                    name: "order.created".into(),
                    version: "v1".into()
                },
                SubscribedEvent {
                    name: "order.paid".into(),
                    version: "v2".into()
                },
            ]
        );
        assert!(subscribed_events("nobody", &subjects).is_empty());
    }
}
