//! The controller API of local mode: Kubernetes-style paths over the resource
//! store. Invalid resources are answered 422 with a Kubernetes `Status` whose causes name each
//! bad field, before anything is stored.

use std::sync::Arc;

use axum::{
    Json, Router,
    body::{Body, Bytes},
    extract::{Path, Query, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
};
use eddy_model::resources::{
    self, API_VERSION, FieldError, Function, SinkPolicy, Subscription, describe_errors,
};
use eddy_platform::store::{Store, StoreError, StoredResource};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// What the API handlers share.
pub struct ApiState {
    /// The resource store.
    pub store: Store,
    /// Where Subscription sinks may point.
    pub sinks: SinkPolicy,
    /// Function logs (`<dir>/<namespace>/<name>.log`).
    pub logs_dir: std::path::PathBuf,
}

type Shared = State<Arc<ApiState>>;

/// Prefix of every resource path.
pub const API_PREFIX: &str = "/apis/eddy.dev/v1alpha1";

/// The API routes (merged into the controller's router).
pub fn router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route(
            &format!("{API_PREFIX}/functions"),
            get(list_all::<Function>),
        )
        .route(
            &format!("{API_PREFIX}/subscriptions"),
            get(list_all::<Subscription>),
        )
        .route(
            &format!("{API_PREFIX}/namespaces/{{namespace}}/functions"),
            get(list::<Function>),
        )
        .route(
            &format!("{API_PREFIX}/namespaces/{{namespace}}/subscriptions"),
            get(list::<Subscription>),
        )
        .route(
            &format!("{API_PREFIX}/namespaces/{{namespace}}/functions/{{name}}"),
            get(read::<Function>)
                .put(apply::<Function>)
                .delete(remove::<Function>),
        )
        .route(
            &format!("{API_PREFIX}/namespaces/{{namespace}}/functions/{{name}}/log"),
            get(function_log),
        )
        .route(
            &format!("{API_PREFIX}/namespaces/{{namespace}}/subscriptions/{{name}}"),
            get(read::<Subscription>)
                .put(apply::<Subscription>)
                .delete(remove::<Subscription>),
        )
        .with_state(state)
}

/// A Kubernetes `Status` failure.
pub fn status(code: StatusCode, reason: &str, message: &str, details: Option<Value>) -> Response {
    eddy_platform::errors::ErrorResponse::kubernetes_status(code, reason, message, details)
        .into_response()
}

fn store_failure(error: &StoreError) -> Response {
    match error {
        StoreError::Conflict(_) => status(
            StatusCode::CONFLICT,
            "Conflict",
            "the resource was changed concurrently; read it again and retry",
            None,
        ),
        other => {
            tracing::error!(error = %other, "resource store failed");
            status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "the resource store is unavailable",
                None,
            )
        }
    }
}

fn invalid<R: StoredResource>(name: &str, errors: &[FieldError]) -> Response {
    let causes: Vec<Value> = errors
        .iter()
        .map(|error| json!({"reason": "FieldValueInvalid", "field": error.field, "message": error.message}))
        .collect();
    status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        &format!(
            "{} \"{name}\" is invalid: {}",
            R::KIND,
            describe_errors(errors)
        ),
        Some(json!({"name": name, "group": resources::GROUP, "kind": R::KIND, "causes": causes})),
    )
}

async fn list_all<R: StoredResource>(state: Shared) -> Response {
    list_in::<R>(&state, None).await
}

async fn list<R: StoredResource>(state: Shared, Path(namespace): Path<String>) -> Response {
    if !resources::is_dns1123_label(&namespace) {
        // No resource can live there.
        return Json(json!({
            "apiVersion": API_VERSION, "kind": format!("{}List", R::KIND), "metadata": {}, "items": [],
        }))
        .into_response();
    }
    list_in::<R>(&state, Some(&namespace)).await
}

async fn list_in<R: StoredResource>(state: &ApiState, namespace: Option<&str>) -> Response {
    match state.store.list::<R>(namespace).await {
        Ok(items) => Json(json!({
            "apiVersion": API_VERSION, "kind": format!("{}List", R::KIND), "metadata": {}, "items": items,
        }))
        .into_response(),
        Err(error) => store_failure(&error),
    }
}

/// Largest resource the store takes (a NATS KV value is one message, 1 MiB by default, and the
/// status is written beside the spec).
pub const MAX_RESOURCE_BYTES: usize = 768 * 1024;

/// Names that can be stored: a namespace and a name that are DNS-1123 labels. Anything else
/// names no resource (404 on reads, 422 on writes) instead of reaching the store.
fn storable(namespace: &str, name: &str) -> bool {
    resources::is_dns1123_label(namespace) && resources::is_dns1123_label(name)
}

async fn read<R: StoredResource>(
    state: Shared,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    if !storable(&namespace, &name) {
        return not_found::<R>(&name);
    }
    match state.store.get::<R>(&namespace, &name).await {
        Ok(Some(resource)) => Json(resource).into_response(),
        Ok(None) => not_found::<R>(&name),
        Err(error) => store_failure(&error),
    }
}

fn not_found<R: StoredResource>(name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{} \"{name}\" not found", R::PLURAL),
        Some(json!({"name": name, "group": resources::GROUP, "kind": R::PLURAL})),
    )
}

async fn remove<R: StoredResource>(
    state: Shared,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    if !storable(&namespace, &name) {
        return not_found::<R>(&name);
    }
    match state.store.delete::<R>(&namespace, &name).await {
        Ok(true) => Json(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": {"name": name, "group": resources::GROUP, "kind": R::PLURAL},
        }))
        .into_response(),
        Ok(false) => not_found::<R>(&name),
        Err(error) => store_failure(&error),
    }
}

/// Decodes a resource body, naming the field at fault when it does not fit the schema.
pub fn decode_resource<R: DeserializeOwned + StoredResource>(
    body: &[u8],
) -> Result<R, Vec<FieldError>> {
    let value: Value = serde_json::from_slice(body).map_err(|error| {
        vec![FieldError {
            field: "body".into(),
            message: format!("not valid JSON: {error}"),
        }]
    })?;
    let mut errors = Vec::new();
    if value.get("apiVersion").and_then(Value::as_str) != Some(API_VERSION) {
        errors.push(FieldError {
            field: "apiVersion".into(),
            message: format!("must be {API_VERSION}"),
        });
    }
    if value.get("kind").and_then(Value::as_str) != Some(R::KIND) {
        errors.push(FieldError {
            field: "kind".into(),
            message: format!("must be {}", R::KIND),
        });
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    serde_path_to_error::deserialize::<_, R>(value).map_err(|error| {
        let path = error.path().to_string();
        let field = if path == "." { "spec".to_owned() } else { path };
        vec![FieldError {
            field,
            message: error.into_inner().to_string(),
        }]
    })
}

/// Validation shared by the API and `eddy apply --dry-run`.
pub trait Validate {
    /// Every problem with the resource.
    fn validate(&self, sinks: &SinkPolicy) -> Vec<FieldError>;
}

impl Validate for Function {
    fn validate(&self, _sinks: &SinkPolicy) -> Vec<FieldError> {
        resources::validate_function(self)
    }
}

impl Validate for Subscription {
    fn validate(&self, sinks: &SinkPolicy) -> Vec<FieldError> {
        resources::validate_subscription(self, sinks)
    }
}

async fn apply<R: StoredResource + Validate>(
    state: Shared,
    Path((namespace, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let is_json = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_none_or(|value| value.starts_with("application/json"));
    if !is_json {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            "send the resource as application/json",
            None,
        );
    }
    if body.len() > MAX_RESOURCE_BYTES {
        return status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestEntityTooLarge",
            &format!(
                "the resource is {} bytes, the limit is {MAX_RESOURCE_BYTES}",
                body.len()
            ),
            None,
        );
    }
    if !storable(&namespace, &name) {
        return invalid::<R>(
            &name,
            &[FieldError {
                field: "metadata.name".into(),
                message: "namespace and name must be DNS labels: lower-case letters, digits and \
                          '-', at most 63 characters"
                    .into(),
            }],
        );
    }
    let mut resource: R = match decode_resource(&body) {
        Ok(resource) => resource,
        Err(errors) => return invalid::<R>(&name, &errors),
    };
    let meta = resource.meta_mut();
    let mut errors = Vec::new();
    match meta.name.as_deref() {
        None => meta.name = Some(name.clone()),
        Some(given) if given != name => errors.push(FieldError {
            field: "metadata.name".into(),
            message: format!("must match the name in the path ({name})"),
        }),
        Some(_) => {}
    }
    match meta.namespace.as_deref() {
        None => meta.namespace = Some(namespace.clone()),
        Some(given) if given != namespace => errors.push(FieldError {
            field: "metadata.namespace".into(),
            message: format!("must match the namespace in the path ({namespace})"),
        }),
        Some(_) => {}
    }
    errors.extend(resource.validate(&state.sinks));
    if !errors.is_empty() {
        return invalid::<R>(&name, &errors);
    }
    match state.store.apply(resource).await {
        Ok((stored, created)) => {
            let code = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            tracing::info!(kind = R::KIND, %namespace, %name, created, "resource applied");
            (code, Json(stored)).into_response()
        }
        Err(error) => store_failure(&error),
    }
}

#[derive(Debug, serde::Deserialize)]
struct LogQuery {
    /// Keep the response open and send new lines as they are written.
    #[serde(default)]
    follow: bool,
}

/// `GET .../functions/{name}/log[?follow=true]`: the instances' stdout and stderr.
async fn function_log(
    state: Shared,
    Path((namespace, name)): Path<(String, String)>,
    Query(query): Query<LogQuery>,
) -> Response {
    match state.store.get::<Function>(&namespace, &name).await {
        Ok(Some(_)) => {}
        Ok(None) => return not_found::<Function>(&name),
        Err(error) => return store_failure(&error),
    }
    if !resources::is_dns1123_label(&namespace) || !resources::is_dns1035_label(&name) {
        return not_found::<Function>(&name);
    }
    let path = state.logs_dir.join(&namespace).join(format!("{name}.log"));
    if !query.follow {
        let text = tokio::fs::read(&path).await.unwrap_or_default();
        return (
            [(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            text,
        )
            .into_response();
    }
    let stream = futures::stream::unfold((path, 0u64), |(path, offset)| async move {
        loop {
            let chunk = read_from(&path, offset).await;
            if !chunk.is_empty() {
                let next = offset + chunk.len() as u64;
                return Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), (path, next)));
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    });
    (
        [(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Bytes of `path` from `offset` on (at most 64 KiB); empty when there are none (yet).
async fn read_from(path: &std::path::Path, offset: u64) -> Vec<u8> {
    use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};
    let Ok(mut file) = tokio::fs::File::open(path).await else {
        return Vec::new();
    };
    if file.seek(std::io::SeekFrom::Start(offset)).await.is_err() {
        return Vec::new();
    }
    let mut buffer = vec![0; 64 * 1024];
    match file.read(&mut buffer).await {
        Ok(read) => {
            buffer.truncate(read);
            buffer
        }
        Err(_) => Vec::new(),
    }
}
