//! Dead letters: listing a Subscription's and sending them back, through the dispatcher's
//! admin API.

use crate::*;

/// Sends a request to the dispatcher's admin API and answers what it answered.
pub(crate) async fn to_dispatcher(
    state: &DashboardState,
    request: impl FnOnce(&reqwest::Client, &str) -> reqwest::RequestBuilder,
) -> Result<Response, ErrorResponse> {
    let Some(url) = &state.dispatcher_url else {
        return Err(ErrorResponse::message(
            StatusCode::SERVICE_UNAVAILABLE,
            "no dispatcher is configured (--dispatcher-url)",
        ));
    };
    match request(&state.http, url)
        .timeout(Duration::from_secs(60))
        .send()
        .await
    {
        Ok(response) => {
            let status =
                StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let body = response.bytes().await.unwrap_or_default();
            Ok((
                status,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                )],
                body,
            )
                .into_response())
        }
        Err(error) => {
            tracing::warn!(%error, "dashboard: cannot reach the dispatcher");
            Err(ErrorResponse::message(
                StatusCode::BAD_GATEWAY,
                "the dispatcher is not reachable",
            ))
        }
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct DeadLetterQuery {
    subscription: Option<String>,
}

pub(crate) async fn dead_letters(
    State(state): State<Arc<DashboardState>>,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Response, ErrorResponse> {
    to_dispatcher(&state, |http, url| match &query.subscription {
        Some(subscription) => http.get(format!(
            "{url}/dead-letters?{}",
            url::form_urlencoded::Serializer::new(String::new())
                .append_pair("subscription", subscription)
                .finish()
        )),
        None => http.get(format!("{url}/dead-letters")),
    })
    .await
}

pub(crate) async fn redrive(
    State(state): State<Arc<DashboardState>>,
    Path((namespace, name)): Path<(String, String)>,
) -> Result<Response, ErrorResponse> {
    if !resources::is_dns1123_label(&namespace) || !resources::is_dns1123_subdomain(&name) {
        return Err(ErrorResponse::message(
            StatusCode::NOT_FOUND,
            "no such subscription",
        ));
    }
    to_dispatcher(&state, |http, url| {
        http.post(format!("{url}/subscriptions/{namespace}/{name}/redrive"))
    })
    .await
}
