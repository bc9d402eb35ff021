//! Publishing a test event from the page, through the event-bus as any publisher does.

use crate::*;

/// A test event from the page's form.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PublishForm {
    #[serde(rename = "type")]
    ty: String,
    source: String,
    /// A new UUID when missing or empty.
    id: Option<String>,
    /// Sent as `application/json`.
    data: Value,
}

/// Publishes a test event through the event-bus (binary mode), so it is checked and stored
/// exactly as any publisher's; answers the event-bus's status and message, and the id.
pub(crate) async fn publish(
    State(state): State<Arc<DashboardState>>,
    Json(form): Json<PublishForm>,
) -> Result<Response, ErrorResponse> {
    let id = form
        .id
        .filter(|id| !id.trim().is_empty())
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    for (field, value) in [("type", &form.ty), ("source", &form.source), ("id", &id)] {
        if value.trim().is_empty() {
            return Err(ErrorResponse::message(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("{field}: must not be empty"),
            ));
        }
        // Sent as a `ce-` header: a line break or another control character cannot be.
        if header::HeaderValue::from_str(value).is_err() {
            return Err(ErrorResponse::message(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("{field}: must hold no line breaks or other control characters"),
            ));
        }
    }
    let mut request = state
        .callers
        .post(format!("{}/publish", state.bus_url))
        .header("ce-specversion", "1.0")
        .header("ce-id", &id)
        .header("ce-source", &form.source)
        .header("ce-type", &form.ty)
        .header(header::CONTENT_TYPE, "application/json")
        .body(form.data.to_string())
        .timeout(Duration::from_secs(10));
    if let Some(token) = &state.bus_token {
        request = request.bearer_auth(token);
    }
    match request.send().await {
        Ok(response) if response.status().is_success() => {
            Ok(Json(json!({"id": id, "source": form.source, "type": form.ty})).into_response())
        }
        Ok(response) => {
            let status = response.status();
            let body = response.bytes().await.unwrap_or_default();
            let message = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|body| {
                    body["error"]
                        .as_str()
                        .or_else(|| body["message"].as_str())
                        .map(str::to_owned)
                })
                .unwrap_or_else(|| shown(&body).0);
            Err(ErrorResponse::message(
                status,
                format!("the event-bus refused it: {message}"),
            ))
        }
        Err(error) => {
            tracing::warn!(%error, "dashboard: cannot reach the event-bus");
            Err(ErrorResponse::message(
                StatusCode::BAD_GATEWAY,
                "the event-bus is not reachable",
            ))
        }
    }
}
