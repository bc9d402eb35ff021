//! Events: the live tail of what is published, and one event's detail.

use crate::*;

/// The text of `bytes` for the page: UTF-8 (lossy) up to [`SHOWN_BYTES`], and whether it
/// was cut.
pub(crate) fn shown(bytes: &[u8]) -> (String, bool) {
    let cut = bytes.len() > SHOWN_BYTES;
    let kept = &bytes[..bytes.len().min(SHOWN_BYTES)];
    (String::from_utf8_lossy(kept).into_owned(), cut)
}

/// One stored event: its attributes, data, the attempts the dispatcher recorded, its dead
/// letters and its trace.
pub(crate) async fn event_detail(
    State(state): State<Arc<DashboardState>>,
    Path(sequence): Path<u64>,
) -> Result<Response, ErrorResponse> {
    let stream = match state.js.get_stream(EVENTS_STREAM).await {
        Ok(stream) => stream,
        Err(error) => {
            tracing::warn!(%error, "dashboard: no event stream");
            return Err(ErrorResponse::message(
                StatusCode::SERVICE_UNAVAILABLE,
                "event stream unavailable",
            ));
        }
    };
    let message = match stream.get_raw_message(sequence).await {
        Ok(message) => message,
        Err(error) => {
            use async_nats::jetstream::stream::RawMessageErrorKind as Kind;
            return if matches!(error.kind(), Kind::NoMessageFound) {
                Err(ErrorResponse::message(
                    StatusCode::NOT_FOUND,
                    format!(
                        "no event at sequence {sequence} (never stored, or removed by the stream's limits)"
                    ),
                ))
            } else {
                tracing::warn!(%error, sequence, "dashboard: cannot read an event");
                Err(ErrorResponse::message(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "cannot read the event from NATS",
                ))
            };
        }
    };
    let mut attributes = serde_json::Map::new();
    let mut traceparent = None;
    for (name, values) in message.headers.iter() {
        let name: &str = name.as_ref();
        let Some(value) = values.first().map(|v| v.as_str().to_owned()) else {
            continue;
        };
        if let Some(attribute) = name.strip_prefix("ce-") {
            attributes.insert(attribute.to_owned(), Value::String(value));
        } else if name.eq_ignore_ascii_case("content-type") {
            attributes.insert("datacontenttype".to_owned(), Value::String(value));
        } else if name.eq_ignore_ascii_case(eddy_model::headers::TRACEPARENT) {
            traceparent = Some(value);
        }
    }
    let (data, truncated) = shown(&message.payload);
    let trace_id = traceparent
        .as_deref()
        .and_then(traces::trace_id_of)
        .map(str::to_owned);
    let trace_url = trace_id.as_deref().and_then(traces::ui_link);
    let (deliveries, dead_letters) = match &state.dispatcher_url {
        Some(url) => {
            // Two independent reads of the dispatcher: asked at once, not one after the other.
            let (deliveries, letters) = futures::join!(
                state
                    .http
                    .get(format!("{url}/deliveries?sequence={sequence}"))
                    .timeout(Duration::from_secs(2))
                    .send(),
                state
                    .http
                    .get(format!("{url}/dead-letters"))
                    .timeout(Duration::from_secs(5))
                    .send(),
            );
            let deliveries = answer::<EventDeliveries>(deliveries)
                .await
                .map(|deliveries| deliveries.items);
            let letters = answer::<DeadLetterList>(letters).await.map(|letters| {
                letters
                    .items
                    .into_iter()
                    .filter(|letter| letter.stream_sequence == sequence)
                    .collect::<Vec<_>>()
            });
            (deliveries, letters)
        }
        None => (None, None),
    };
    Ok(Json(json!({
        "sequence": sequence,
        "subject": message.subject.as_str(),
        "stored": eddy_platform::nats::stored_time(message.time.unix_timestamp(), message.time.nanosecond()),
        "attributes": attributes,
        "data": data,
        "truncated": truncated,
        "deliveriesKnown": deliveries.is_some(),
        "deliveries": deliveries.unwrap_or_default(),
        "deadLetters": dead_letters.unwrap_or_default(),
        "traceId": trace_id,
        "traceUrl": trace_url,
    }))
    .into_response())
}

pub(crate) fn summary(message: &jetstream::Message) -> Value {
    let header = |name: &str| {
        message
            .headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default()
    };
    let info = message.info().ok();
    let sequence = info.as_ref().map_or(0, |info| info.stream_sequence);
    let mut time = header("ce-time");
    if time.is_empty() {
        // No `time` attribute: show when JetStream stored it.
        if let Some(published) = info.map(|info| info.published) {
            time = eddy_platform::nats::stored_time(
                published.unix_timestamp(),
                published.nanosecond(),
            );
        }
    }
    json!({
        "sequence": sequence,
        "type": header("ce-type"),
        "source": header("ce-source"),
        "id": header("ce-id"),
        "time": time,
        "bytes": message.payload.len(),
    })
}

pub(crate) async fn tail(State(state): State<Arc<DashboardState>>) -> Response {
    let unavailable =
        || (StatusCode::SERVICE_UNAVAILABLE, "event stream unavailable").into_response();
    let mut stream = match state.js.get_stream(EVENTS_STREAM).await {
        Ok(stream) => stream,
        Err(error) => {
            tracing::warn!(%error, "dashboard tail: no stream");
            return unavailable();
        }
    };
    // The last TAIL_HISTORY events first, then what comes.
    let start = match stream.info().await {
        Ok(info) => info
            .state
            .last_sequence
            .saturating_sub(TAIL_HISTORY - 1)
            .max(1),
        Err(_) => 1,
    };
    let consumer = stream
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ..Default::default()
        })
        .await;
    let messages = match consumer {
        Ok(consumer) => consumer.messages().await,
        Err(error) => {
            tracing::warn!(%error, "dashboard tail: cannot create consumer");
            return unavailable();
        }
    };
    let messages = match messages {
        Ok(messages) => messages,
        Err(error) => {
            tracing::warn!(%error, "dashboard tail: cannot read the consumer");
            return unavailable();
        }
    };
    let events = messages.filter_map(|message| async move {
        let message = message.ok()?;
        Some(Ok::<_, Infallible>(
            Event::default()
                .event("cloudevent")
                .data(summary(&message).to_string()),
        ))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
