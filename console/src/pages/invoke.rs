//! Calling a Function from the page, through the gateway as any caller does.

use crate::*;

/// A call from the page's form.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct InvokeForm {
    namespace: String,
    name: String,
    method: String,
    /// Path and query after the function's address, from `/`.
    path: String,
    #[serde(default)]
    headers: Vec<(String, String)>,
    #[serde(default)]
    body: String,
}

/// Headers the page may not set on a call: the connection's own.
pub(crate) const HOP_BY_HOP: [&str; 8] = [
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
];

/// The gateway URL of a dashboard call of `namespace/name` at `path`, or `None` when the call
/// would leave the function's own address. `path` must be visible ASCII (no spaces, tabs or
/// other controls, which URL parsers drop, and no backslash, which they read as `/`), without a
/// fragment or a `.`/`..` segment (plain or percent-encoded); and the URL as parsed must still
/// be under `/<namespace>/<name>`. Pure.
pub fn invoke_url(gateway: &str, namespace: &str, name: &str, path: &str) -> Option<String> {
    let path_only = path.split('?').next().unwrap_or_default();
    let climbs = path_only.split('/').any(|segment| {
        let segment = segment.to_ascii_lowercase().replace("%2e", ".");
        segment == ".." || segment == "."
    });
    let visible = path
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'\\' && b != b'#');
    if !path.starts_with('/') || !visible || climbs {
        return None;
    }
    let url = format!(
        "{gateway}/{namespace}/{name}{}",
        if path == "/" { "" } else { path }
    );
    let parsed = url::Url::parse(&url).ok()?;
    let base = format!("/{namespace}/{name}");
    let inside = parsed.path() == base || parsed.path().starts_with(&format!("{base}/"));
    inside.then_some(url)
}

/// Calls a function through the gateway, as any caller would (its access rules apply), and
/// answers the status, headers, body and time taken.
pub(crate) async fn invoke(
    State(state): State<Arc<DashboardState>>,
    Json(form): Json<InvokeForm>,
) -> Result<Response, ErrorResponse> {
    if !resources::is_dns1123_label(&form.namespace) {
        return Err(ErrorResponse::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "namespace: not a namespace name",
        ));
    }
    if !resources::is_dns1035_label(&form.name) {
        return Err(ErrorResponse::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "name: not a function name",
        ));
    }
    let Ok(method) = reqwest::Method::from_bytes(form.method.as_bytes()) else {
        return Err(ErrorResponse::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "method: not an HTTP method",
        ));
    };
    let Some(url) = invoke_url(&state.gateway_url, &form.namespace, &form.name, &form.path) else {
        return Err(ErrorResponse::message(
            StatusCode::UNPROCESSABLE_ENTITY,
            "path: must start with / and hold only visible ASCII, no backslash, fragment or . and .. segments",
        ));
    };
    let mut headers = reqwest::header::HeaderMap::new();
    for (name, value) in &form.headers {
        let (Ok(header_name), Ok(header_value)) = (
            reqwest::header::HeaderName::from_bytes(name.trim().as_bytes()),
            reqwest::header::HeaderValue::from_str(value.trim()),
        ) else {
            return Err(ErrorResponse::message(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("headers: {name:?} is not a valid header"),
            ));
        };
        if HOP_BY_HOP.contains(&header_name.as_str()) {
            continue;
        }
        headers.append(header_name, header_value);
    }
    let started = Instant::now();
    let sent = state
        .callers
        .request(method, url)
        .headers(headers)
        .body(form.body)
        .timeout(Duration::from_secs(300))
        .send()
        .await;
    let response = match sent {
        Ok(response) => response,
        Err(error) => {
            tracing::debug!(%error, "dashboard: the call failed");
            return Err(ErrorResponse::message(
                StatusCode::BAD_GATEWAY,
                format!(
                    "the call failed: {}",
                    if error.is_timeout() {
                        "no answer within 5 minutes"
                    } else {
                        "the gateway is not reachable"
                    }
                ),
            ));
        }
    };
    let status = response.status().as_u16();
    let answer_headers: Vec<(String, String)> = response
        .headers()
        .iter()
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect();
    let mut body = Vec::new();
    let mut truncated = false;
    let mut response = response;
    loop {
        match response.chunk().await {
            Ok(None) => break,
            Ok(Some(chunk)) => {
                let room = SHOWN_BYTES.saturating_sub(body.len());
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if chunk.len() > room {
                    truncated = true;
                    break;
                }
            }
            Err(error) => {
                tracing::debug!(%error, "dashboard: the answer broke off");
                truncated = true;
                break;
            }
        }
    }
    Ok(Json(json!({
        "status": status,
        "headers": answer_headers,
        "body": String::from_utf8_lossy(&body),
        "truncated": truncated,
        "millis": started.elapsed().as_secs_f64() * 1000.0,
    }))
    .into_response())
}
