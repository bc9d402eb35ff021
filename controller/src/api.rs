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
use eddy_model::apirule::{self, APIRule};
use eddy_model::istio::{self, Istio};
use eddy_model::ratelimit::{self, RateLimit};
use eddy_model::resources::{
    self, API_VERSION, APPLIED_AS_ANNOTATION, FieldError, Function, KYMA_FUNCTION_API_VERSION,
    KYMA_SUBSCRIPTION_API_VERSION, SinkPolicy, Subscription, describe_errors, is_config_key,
};
use eddy_platform::store::{Store, StoreError, StoredResource};
use k8s_openapi::{
    ByteString,
    api::core::v1::{ConfigMap, Secret},
};
use serde_json::{Value, json};

/// What the API handlers share.
pub struct ApiState {
    /// The resource store.
    pub store: Store,
    /// The operator's settings that validation follows.
    pub policy: Policy,
    /// Every APIRule the local follower knows (an APIRule being applied is judged among them).
    pub known_apirules: crate::apirules::KnownApiRules,
    /// Function logs (`<dir>/<namespace>/<name>.log`).
    pub logs_dir: std::path::PathBuf,
    /// The local backend, for the instances of each function.
    pub backend: Option<Arc<crate::local::LocalController>>,
}

/// The operator's settings that decide whether a resource is valid, beyond the resource itself.
pub struct Policy {
    /// Where Subscription sinks may point.
    pub sinks: SinkPolicy,
    /// How APIRules are served: the domain, and the namespaces open to other namespaces'
    /// APIRules.
    pub apirules: eddy_platform::flags::ApiRuleArgs,
}

type Shared = State<Arc<ApiState>>;

/// Prefix of every resource path.
pub const API_PREFIX: &str = "/apis/eddy.dev/v1alpha1";

/// The API routes (merged into the controller's router).
pub fn router(state: Arc<ApiState>) -> Router {
    let kyma_functions = "/apis/serverless.kyma-project.io/v1alpha2";
    let kyma_subscriptions = "/apis/eventing.kyma-project.io/v1alpha2";
    let router = Router::new()
        .route(
            &format!("{kyma_functions}/namespaces/{{namespace}}/functions"),
            get(list::<Function>),
        )
        .route(
            &format!("{kyma_functions}/namespaces/{{namespace}}/functions/{{name}}"),
            get(read::<Function>)
                .put(apply::<Function>)
                .delete(remove::<Function>),
        )
        .route(
            &format!("{kyma_subscriptions}/namespaces/{{namespace}}/subscriptions"),
            get(list::<Subscription>),
        )
        .route(
            &format!("{kyma_subscriptions}/namespaces/{{namespace}}/subscriptions/{{name}}"),
            get(read::<Subscription>)
                .put(apply::<Subscription>)
                .delete(remove::<Subscription>),
        )
        .route("/api/v1/secrets", get(list_all::<Secret>))
        .route("/api/v1/configmaps", get(list_all::<ConfigMap>))
        .route(
            "/api/v1/namespaces/{namespace}/secrets",
            get(list::<Secret>),
        )
        .route(
            "/api/v1/namespaces/{namespace}/configmaps",
            get(list::<ConfigMap>),
        )
        .route(
            "/api/v1/namespaces/{namespace}/secrets/{name}",
            get(read::<Secret>)
                .put(apply::<Secret>)
                .delete(remove::<Secret>),
        )
        .route(
            "/api/v1/namespaces/{namespace}/configmaps/{name}",
            get(read::<ConfigMap>)
                .put(apply::<ConfigMap>)
                .delete(remove::<ConfigMap>),
        )
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
            &format!("{API_PREFIX}/namespaces/{{namespace}}/functions/{{name}}/instances"),
            get(function_instances),
        )
        .route(
            &format!("{API_PREFIX}/namespaces/{{namespace}}/subscriptions/{{name}}"),
            get(read::<Subscription>)
                .put(apply::<Subscription>)
                .delete(remove::<Subscription>),
        );
    ratelimit_routes(istio_routes(apirule_routes(router))).with_state(state)
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

fn invalid<R: ApiResource>(name: &str, errors: &[FieldError]) -> Response {
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
        Some(json!({"name": name, "group": R::GROUP, "kind": R::KIND, "causes": causes})),
    )
}

/// Kyma's RateLimit (the gateway keeps its buckets).
fn ratelimit_routes(router: Router<Arc<ApiState>>) -> Router<Arc<ApiState>> {
    let base = format!("/apis/{}", ratelimit::API_VERSION);
    router
        .route(&format!("{base}/ratelimits"), get(list_all::<RateLimit>))
        .route(
            &format!("{base}/namespaces/{{namespace}}/ratelimits"),
            get(list::<RateLimit>),
        )
        .route(
            &format!("{base}/namespaces/{{namespace}}/ratelimits/{{name}}"),
            get(read::<RateLimit>)
                .put(apply::<RateLimit>)
                .delete(remove::<RateLimit>),
        )
}

/// Kyma's Istio resource (its authorizers are the gateway's too).
fn istio_routes(router: Router<Arc<ApiState>>) -> Router<Arc<ApiState>> {
    let base = format!("/apis/{}", istio::API_VERSION);
    router
        .route(&format!("{base}/istios"), get(list_all::<Istio>))
        .route(
            &format!("{base}/namespaces/{{namespace}}/istios"),
            get(list::<Istio>),
        )
        .route(
            &format!("{base}/namespaces/{{namespace}}/istios/{{name}}"),
            get(read::<Istio>)
                .put(apply::<Istio>)
                .delete(remove::<Istio>),
        )
}

/// Kyma's APIRule, served at both its versions (`v2`, `v2alpha1`: the same objects).
fn apirule_routes(mut router: Router<Arc<ApiState>>) -> Router<Arc<ApiState>> {
    for version in [apirule::VERSION, apirule::VERSION_ALPHA] {
        let base = format!("/apis/{}/{version}", apirule::GROUP);
        router = router
            .route(&format!("{base}/apirules"), get(list_all::<APIRule>))
            .route(
                &format!("{base}/namespaces/{{namespace}}/apirules"),
                get(list::<APIRule>),
            )
            .route(
                &format!("{base}/namespaces/{{namespace}}/apirules/{{name}}"),
                get(read::<APIRule>)
                    .put(apply::<APIRule>)
                    .delete(remove::<APIRule>),
            );
    }
    router
}

async fn list_all<R: ApiResource>(state: Shared) -> Response {
    list_in::<R>(&state, None).await
}

async fn list<R: ApiResource>(state: Shared, Path(namespace): Path<String>) -> Response {
    if !resources::is_dns1123_label(&namespace) {
        // No resource can live there.
        return Json(json!({
            "apiVersion": R::API_VERSION, "kind": format!("{}List", R::KIND), "metadata": {}, "items": [],
        }))
        .into_response();
    }
    list_in::<R>(&state, Some(&namespace)).await
}

async fn list_in<R: ApiResource>(state: &ApiState, namespace: Option<&str>) -> Response {
    match state.store.list::<R>(namespace).await {
        Ok(items) => {
            let items: Vec<Value> = items.iter().map(R::shown).collect();
            Json(json!({
                "apiVersion": R::API_VERSION, "kind": format!("{}List", R::KIND), "metadata": {}, "items": items,
            }))
            .into_response()
        }
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

async fn read<R: ApiResource>(
    state: Shared,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    if !storable(&namespace, &name) {
        return not_found::<R>(&name);
    }
    match state.store.get::<R>(&namespace, &name).await {
        Ok(Some(resource)) => Json(R::shown(&resource)).into_response(),
        Ok(None) => not_found::<R>(&name),
        Err(error) => store_failure(&error),
    }
}

fn not_found<R: ApiResource>(name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{} \"{name}\" not found", R::PLURAL),
        Some(json!({"name": name, "group": R::GROUP, "kind": R::PLURAL})),
    )
}

async fn remove<R: ApiResource>(
    state: Shared,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    if !storable(&namespace, &name) {
        return not_found::<R>(&name);
    }
    match state.store.delete::<R>(&namespace, &name).await {
        Ok(true) => Json(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": {"name": name, "group": R::GROUP, "kind": R::PLURAL},
        }))
        .into_response(),
        Ok(false) => not_found::<R>(&name),
        Err(error) => store_failure(&error),
    }
}

/// Decodes a resource body, naming the field at fault when it does not fit the schema. Returns
/// the resource and the `apiVersion` it was written with (one of [`ApiResource::API_VERSIONS`]).
pub fn decode_resource<R: ApiResource>(body: &[u8]) -> Result<(R, &'static str), Vec<FieldError>> {
    let mut value: Value = serde_json::from_slice(body).map_err(|error| {
        vec![FieldError {
            field: "body".into(),
            message: format!("not valid JSON: {error}"),
        }]
    })?;
    let mut errors = Vec::new();
    let given = value.get("apiVersion").and_then(Value::as_str);
    let api_version = R::API_VERSIONS
        .iter()
        .copied()
        .find(|known| Some(*known) == given);
    if api_version.is_none() {
        errors.push(FieldError {
            field: "apiVersion".into(),
            message: format!("must be {}", R::API_VERSIONS.join(" or ")),
        });
    }
    if value.get("kind").and_then(Value::as_str) != Some(R::KIND) {
        errors.push(FieldError {
            field: "kind".into(),
            message: format!("must be {}", R::KIND),
        });
    }
    let Some(api_version) = api_version.filter(|_| errors.is_empty()) else {
        return Err(errors);
    };
    // The typed resources carry their own apiVersion; the one given was checked above. A
    // written `status` is dropped, whatever it holds, as the Kubernetes API server drops it
    // from a resource with a status subresource: the controllers write it. (Kyma's Go client
    // sends a Subscription with its zero status, `backend: {}` among it.)
    if let Some(object) = value.as_object_mut() {
        object.insert("apiVersion".into(), Value::from(R::API_VERSION));
        object.remove("status");
    }
    serde_path_to_error::deserialize::<_, R>(value)
        .map(|resource| (resource, api_version))
        .map_err(|error| {
            let path = error.path().to_string();
            let field = if path == "." { "spec".to_owned() } else { path };
            vec![FieldError {
                field,
                message: error.into_inner().to_string(),
            }]
        })
}

/// What the API needs of each kind it serves.
pub trait ApiResource: StoredResource {
    /// The `apiVersion` it is stored and listed under.
    const API_VERSION: &'static str;
    /// Every `apiVersion` accepted on writes (the first is [`Self::API_VERSION`]).
    const API_VERSIONS: &'static [&'static str];
    /// The API group named in errors.
    const GROUP: &'static str;

    /// Every problem with the resource.
    fn validate(&self, policy: &Policy) -> Vec<FieldError>;

    /// Warnings that depend on what else is stored: an APIRule that another holds a host of
    /// is accepted, but not honoured, and whoever applied it should hear so at once.
    fn standing(&self, _state: &ApiState) -> impl std::future::Future<Output = Vec<String>> + Send {
        std::future::ready(Vec::new())
    }

    /// Readies a decoded resource for the store: records the `apiVersion` it came in with, or
    /// folds `stringData` into `data`.
    fn prepare(&mut self, applied_as: &str);

    /// The resource as the API shows it.
    fn shown(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Warnings for the client (`Warning` headers), such as fields local mode ignores.
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Records the Kyma `apiVersion` a Function or Subscription was applied with (or forgets it
/// when the eddy form was applied).
fn record_applied_as(meta: &mut resources::ObjectMeta, applied_as: &str) {
    let annotations = meta.annotations.get_or_insert_with(Default::default);
    if applied_as == API_VERSION {
        annotations.remove(APPLIED_AS_ANNOTATION);
    } else {
        annotations.insert(APPLIED_AS_ANNOTATION.to_owned(), applied_as.to_owned());
    }
    if annotations.is_empty() {
        meta.annotations = None;
    }
}

/// A Function or Subscription in the form it was applied: Kyma's `apiVersion` when it came as
/// Kyma's.
fn in_applied_form<R: StoredResource>(resource: &R, accepted: &[&str]) -> Value {
    let mut value = serde_json::to_value(resource).unwrap_or(Value::Null);
    let applied_as = resource
        .meta()
        .annotations
        .as_ref()
        .and_then(|a| a.get(APPLIED_AS_ANNOTATION))
        .filter(|given| accepted.contains(&given.as_str()))
        .cloned();
    if let (Some(applied_as), Some(object)) = (applied_as, value.as_object_mut()) {
        object.insert("apiVersion".into(), Value::from(applied_as));
    }
    value
}

impl ApiResource for Function {
    const API_VERSION: &'static str = API_VERSION;
    const API_VERSIONS: &'static [&'static str] = &[API_VERSION, KYMA_FUNCTION_API_VERSION];
    const GROUP: &'static str = resources::GROUP;

    fn validate(&self, _policy: &Policy) -> Vec<FieldError> {
        resources::validate_function(self)
    }

    fn prepare(&mut self, applied_as: &str) {
        record_applied_as(&mut self.metadata, applied_as);
    }

    fn shown(&self) -> Value {
        in_applied_form(self, Self::API_VERSIONS)
    }

    fn warnings(&self) -> Vec<String> {
        let mut warnings: Vec<String> = self
            .spec
            .kubernetes_only_fields()
            .into_iter()
            .map(|field| format!("{field} is ignored in local mode; it applies on Kubernetes"))
            .collect();
        warnings.extend(self.spec.deprecated_fields());
        warnings
    }
}

impl ApiResource for Subscription {
    const API_VERSION: &'static str = API_VERSION;
    const API_VERSIONS: &'static [&'static str] = &[API_VERSION, KYMA_SUBSCRIPTION_API_VERSION];
    const GROUP: &'static str = resources::GROUP;

    fn validate(&self, policy: &Policy) -> Vec<FieldError> {
        resources::validate_subscription(self, &policy.sinks)
    }

    fn prepare(&mut self, applied_as: &str) {
        record_applied_as(&mut self.metadata, applied_as);
    }

    fn shown(&self) -> Value {
        in_applied_form(self, Self::API_VERSIONS)
    }

    fn warnings(&self) -> Vec<String> {
        self.spec.ignored_fields()
    }
}

impl ApiResource for APIRule {
    const API_VERSION: &'static str = apirule::API_VERSION;
    const API_VERSIONS: &'static [&'static str] =
        &[apirule::API_VERSION, apirule::API_VERSION_ALPHA];
    const GROUP: &'static str = apirule::GROUP;

    fn validate(&self, policy: &Policy) -> Vec<FieldError> {
        // An authorizer the gateway lacks does not refuse it: an Istio resource may bring it
        // (applied later, or later in the same file); until then its status says so.
        policy.apirules.refusals(self)
    }

    fn prepare(&mut self, _applied_as: &str) {}

    fn warnings(&self) -> Vec<String> {
        self.spec.warnings()
    }

    async fn standing(&self, state: &ApiState) -> Vec<String> {
        // Judged in memory, among the APIRules the follower knows: an apply reads no more of
        // the store than it writes, however many APIRules there are.
        let judged = {
            let known = state.known_apirules.lock();
            let all: Vec<&APIRule> = known.values().collect();
            crate::apirules::judge(self, &all, &state.policy.apirules, |_| false)
        };
        match judged {
            Ok(_) => Vec::new(),
            Err(problem) => vec![format!(
                "not honoured: {problem}; its status is Error, and the Functions it names \
                 refuse calls on the gateway's own path until it is Ready"
            )],
        }
    }
}

/// Most bytes of data one Secret or ConfigMap holds, as on Kubernetes.
const MAX_DATA_BYTES: usize = 1024 * 1024;

fn validate_data<'a>(
    name_field: &str,
    keys: impl Iterator<Item = (&'a String, usize)>,
    errors: &mut Vec<FieldError>,
) {
    let mut total = 0;
    for (key, size) in keys {
        total += size;
        if !is_config_key(key) {
            errors.push(FieldError {
                field: format!("{name_field}[{key}]"),
                message: "a key is letters, digits, '-', '_' and '.', at most 253".into(),
            });
        }
    }
    if total > MAX_DATA_BYTES {
        errors.push(FieldError {
            field: name_field.to_owned(),
            message: format!("holds {total} bytes; at most {MAX_DATA_BYTES}"),
        });
    }
}

impl ApiResource for Secret {
    const API_VERSION: &'static str = "v1";
    const API_VERSIONS: &'static [&'static str] = &["v1"];
    const GROUP: &'static str = "";

    fn validate(&self, _policy: &Policy) -> Vec<FieldError> {
        let mut errors = Vec::new();
        if let Some(data) = &self.data {
            validate_data(
                "data",
                data.iter().map(|(k, v)| (k, v.0.len())),
                &mut errors,
            );
        }
        errors
    }

    fn prepare(&mut self, _applied_as: &str) {
        // As Kubernetes does: stringData is written into data, and only data is kept.
        if let Some(strings) = self.string_data.take() {
            let data = self.data.get_or_insert_with(Default::default);
            for (key, value) in strings {
                data.insert(key, ByteString(value.into_bytes()));
            }
        }
        self.type_.get_or_insert_with(|| "Opaque".to_owned());
    }

    /// Never the values: the keys only, each with its size.
    fn shown(&self) -> Value {
        let keys: serde_json::Map<String, Value> = self
            .data
            .iter()
            .flatten()
            .map(|(key, value)| (key.clone(), json!(format!("({} bytes)", value.0.len()))))
            .collect();
        json!({
            "apiVersion": "v1", "kind": "Secret", "metadata": self.metadata,
            "type": self.type_, "dataKeys": keys,
        })
    }
}

impl ApiResource for ConfigMap {
    const API_VERSION: &'static str = "v1";
    const API_VERSIONS: &'static [&'static str] = &["v1"];
    const GROUP: &'static str = "";

    fn validate(&self, _policy: &Policy) -> Vec<FieldError> {
        let mut errors = Vec::new();
        let text = self.data.iter().flatten().map(|(k, v)| (k, v.len()));
        let binary = self
            .binary_data
            .iter()
            .flatten()
            .map(|(k, v)| (k, v.0.len()));
        validate_data("data", text.chain(binary), &mut errors);
        errors
    }

    fn prepare(&mut self, _applied_as: &str) {}
}

impl ApiResource for RateLimit {
    const API_VERSION: &'static str = ratelimit::API_VERSION;
    const API_VERSIONS: &'static [&'static str] = &[ratelimit::API_VERSION];
    const GROUP: &'static str = ratelimit::GROUP;

    /// Refused where Kyma's status would say `Error` (its fill intervals, in its words): on
    /// eddy an apply answers at once.
    fn validate(&self, _policy: &Policy) -> Vec<FieldError> {
        self.spec.validate()
    }

    fn prepare(&mut self, _applied_as: &str) {}
}

impl ApiResource for Istio {
    const API_VERSION: &'static str = istio::API_VERSION;
    const API_VERSIONS: &'static [&'static str] = &[istio::API_VERSION];
    const GROUP: &'static str = istio::GROUP;

    fn validate(&self, policy: &Policy) -> Vec<FieldError> {
        Istio::validate(self, policy.apirules.own_providers())
    }

    fn prepare(&mut self, _applied_as: &str) {}

    async fn standing(&self, state: &ApiState) -> Vec<String> {
        // Its authorizers are in force before the answer: an APIRule applied next names them.
        crate::istio::settle(&state.store, &state.policy.apirules).await;
        match state
            .store
            .get_status::<Istio>(
                self.metadata.namespace.as_deref().unwrap_or_default(),
                self.metadata.name.as_deref().unwrap_or_default(),
            )
            .await
        {
            Ok(Some(status)) if status.state != "Ready" => {
                vec![status.description.unwrap_or(status.state)]
            }
            _ => Vec::new(),
        }
    }
}

/// Query parameters of a write.
#[derive(Debug, Default, serde::Deserialize)]
pub struct ApplyParams {
    /// `All`: validate and answer what would be stored, storing nothing (as Kubernetes).
    #[serde(rename = "dryRun")]
    dry_run: Option<String>,
}

async fn apply<R: ApiResource>(
    state: Shared,
    Path((namespace, name)): Path<(String, String)>,
    Query(params): Query<ApplyParams>,
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
    let (mut resource, applied_as): (R, _) = match decode_resource(&body) {
        Ok(decoded) => decoded,
        Err(errors) => return invalid::<R>(&name, &errors),
    };
    resource.prepare(applied_as);
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
    errors.extend(resource.validate(&state.policy));
    if !errors.is_empty() {
        return invalid::<R>(&name, &errors);
    }
    if let Some(dry_run) = params.dry_run.as_deref() {
        if dry_run != "All" {
            return invalid::<R>(
                &name,
                &[FieldError {
                    field: "dryRun".into(),
                    message: "must be All".into(),
                }],
            );
        }
        // Standing is judged on the stored object (its creation time decides who holds a
        // host), so a dry run leaves it out.
        return with_warnings(
            (StatusCode::OK, Json(R::shown(&resource))).into_response(),
            &resource,
            Vec::new(),
        );
    }
    match state.store.apply(resource).await {
        Ok((stored, created)) => {
            let code = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            tracing::info!(kind = R::KIND, %namespace, %name, created, "resource applied");
            let standing = stored.standing(&state).await;
            with_warnings(
                (code, Json(R::shown(&stored))).into_response(),
                &stored,
                standing,
            )
        }
        Err(error) => store_failure(&error),
    }
}

/// Adds `resource`'s warnings, and those its standing among the stored ones gives, to
/// `response` as `Warning` headers.
fn with_warnings<R: ApiResource>(
    mut response: Response,
    resource: &R,
    standing: Vec<String>,
) -> Response {
    for warning in resource.warnings().into_iter().chain(standing) {
        // RFC 7234 warn-code 299, as the Kubernetes API server sends warnings.
        let text = format!("299 - \"{}\"", warning.replace('"', "'"));
        if let Ok(value) = http::HeaderValue::from_str(&text) {
            response.headers_mut().append(http::header::WARNING, value);
        }
    }
    response
}

/// `GET .../functions/{name}/instances`: the function's running instances as a `PodList`, each
/// with the Function's labels and annotations.
async fn function_instances(
    state: Shared,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    match state
        .backend
        .as_ref()
        .and_then(|backend| backend.instances(&namespace, &name))
    {
        Some(list) => Json(list).into_response(),
        None => not_found::<Function>(&name),
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
