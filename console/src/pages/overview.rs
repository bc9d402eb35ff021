//! The overview: Functions, Subscriptions and their delivery counts, and the charts, in one
//! snapshot the page polls.

use crate::*;

pub(crate) async fn snapshot(
    State(state): State<Arc<DashboardState>>,
    request_headers: HeaderMap,
) -> Response {
    let functions = state.store.list::<Function>(None).await.unwrap_or_default();
    let subscriptions = state
        .store
        .list::<Subscription>(None)
        .await
        .unwrap_or_default();
    // As sampled for the charts (every 2 s, as often as the page polls).
    let counts = state
        .dispatcher_items
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let item_of = |namespace: &str, name: &str| {
        counts
            .iter()
            .flatten()
            .find(|item| item.namespace == namespace && item.name == name)
    };
    let subscriptions: Vec<Value> = subscriptions
        .iter()
        .map(|sub| {
            let namespace = sub.metadata.namespace.as_deref().unwrap_or("default");
            let name = sub.metadata.name.as_deref().unwrap_or("");
            let item = item_of(namespace, name);
            let function = resources::parse_function_sink(&sub.spec.sink)
                .map(|sink| format!("{}/{}", sink.namespace, sink.function));
            json!({
                "resource": sub,
                "counts": item.map(|item| item.counts),
                "replyTypes": item.map(|item| item.reply_types.as_slice()).unwrap_or_default(),
                "function": function,
            })
        })
        .collect();
    // What the tables show, not the functions' source and env (secrets may be in env).
    let functions: Vec<Value> = functions
        .iter()
        .map(|function| {
            json!({
                "metadata": {"namespace": function.metadata.namespace, "name": function.metadata.name},
                "spec": {"runtime": function.spec.runtime},
                "status": function.status,
            })
        })
        .collect();
    let body = json!({
        "functions": functions,
        "subscriptions": subscriptions,
        "dispatcher": counts.is_some(),
        "charts": state.charts(),
    })
    .to_string();
    // The page polls every 2 s: an unchanged state is answered 304 with no body (the browser
    // revalidates by itself thanks to `no-cache`).
    let tag = {
        use sha2::{Digest as _, Sha256};
        format!("\"{:x}\"", Sha256::digest(body.as_bytes()))
    };
    let matches = request_headers
        .get(header::IF_NONE_MATCH)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|given| given.split(',').any(|one| one.trim() == tag));
    let mut response = if matches {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response()
    };
    if let Ok(tag) = HeaderValue::from_str(&tag) {
        response.headers_mut().insert(header::ETAG, tag);
    }
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
