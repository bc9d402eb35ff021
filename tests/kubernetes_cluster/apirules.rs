//! Kyma's APIRules and Istio resource: reported by the controller and honoured by the gateway.

use super::*;

/// Kyma's APIRules on the real API server, under the chart's RBAC: both versions are served
/// (the CRD takes Kyma's tutorial manifests as written), the controller reports Kyma's status
/// (Ready with the URL; Error for a host an older APIRule holds, for an `extAuth` authorizer
/// the gateway lacks, and for a Service in another namespace), and the gateway routes a named host to the rule's Service:
/// noAuth 200, JWT 401 without a token and 200 with one, a method no rule lists 404; the
/// APIRule crossing namespaces routes nothing.
#[tokio::test]
async fn apirules_are_reported_by_the_controller_and_honoured_by_the_gateway() {
    use support::jwt::{ISSUER, ISSUER_KEY, jwt, serve_jwks};
    let _serial = serial().await;
    let cluster = Cluster::new("apirules").await;
    let ns = cluster.namespace.clone();
    let (jwks_uri, _) = serve_jwks().await;
    let (controller, gateway, url) = kyma_controller_and_gateway(&cluster).await;
    let yaml = format!(
        r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: hello
  namespace: {ns}
spec:
  hosts:
    - hello
  service:
    name: hello
    namespace: {ns}
    port: 80
  gateway: kyma-system/kyma-gateway
  rules:
    - path: /*
      methods: ["GET", "POST"]
      noAuth: true
---
apiVersion: gateway.kyma-project.io/v2alpha1
kind: APIRule
metadata:
  name: secured
  namespace: {ns}
spec:
  hosts:
    - secured.example.com
  service:
    name: secured
    namespace: {ns}
    port: 8080
  gateway: kyma-system/kyma-gateway
  rules:
    - jwt:
        authentications:
          - issuer: {ISSUER}
            jwksUri: {jwks_uri}
      methods:
        - GET
      path: /*
"#
    );
    cluster.kubectl_apply(&yaml).unwrap();
    let rules = cluster.dynamic("gateway.kyma-project.io/v2", "APIRule");
    let state_of = |name: &'static str| {
        let rules = rules.clone();
        async move {
            let rule = rules.get(name).await.ok()?;
            let status = rule.data.get("status")?.clone();
            Some((
                status["state"].as_str()?.to_owned(),
                status["description"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                status["lastProcessedTime"].is_string(),
            ))
        }
    };
    eventually("both APIRules Ready", Duration::from_secs(60), || async {
        state_of("hello").await.is_some_and(|s| s.0 == "Ready")
            && state_of("secured").await.is_some_and(|s| s.0 == "Ready")
    })
    .await
    .unwrap();
    assert_eq!(
        state_of("hello").await.unwrap(),
        (
            "Ready".to_owned(),
            "exposed on https://hello.localhost".to_owned(),
            true
        )
    );
    // Created after `hello` (or in its second: then by name, and `hello` < `other-hello`).
    let refused = format!(
        r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: other-hello
  namespace: {ns}
spec:
  hosts: [hello]
  service: {{name: other, port: 80}}
  rules: [{{path: /*, methods: [GET], noAuth: true}}]
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: outsourced
  namespace: {ns}
spec:
  hosts: [outsourced]
  service: {{name: other, port: 80}}
  rules:
    - path: /*
      methods: [GET]
      extAuth:
        authorizers: [oauth2-proxy]
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: crossing
  namespace: {ns}
spec:
  hosts: [crossing]
  service: {{name: eddy-controller, namespace: eddy-system, port: 8082}}
  rules: [{{path: /*, methods: [GET], noAuth: true}}]
"#
    );
    cluster.kubectl_apply(&refused).unwrap();
    eventually("the refusals", Duration::from_secs(60), || async {
        let copy = state_of("other-hello").await;
        let outsourced = state_of("outsourced").await;
        let crossing = state_of("crossing").await;
        copy.is_some_and(|s| {
            s.0 == "Error"
                && s.1 == format!("host hello.localhost is already exposed by APIRule {ns}/hello")
        }) && outsourced
            .is_some_and(|s| s.0 == "Error" && s.1.contains("spec.rules[0].extAuth.authorizers[0]"))
            && crossing.is_some_and(|s| {
                s.0 == "Error"
                    && s.1.starts_with(&format!(
                        "spec.service.namespace: an APIRule in namespace {ns} cannot send calls \
                         to namespace eddy-system"
                    ))
            })
    })
    .await
    .unwrap();

    // The gateway: the host decides the APIRule, the rule the Service and who may call.
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let port = addr.port();
    let hosts = reqwest::Client::builder()
        .resolve("hello.localhost", addr)
        .resolve("secured.example.com", addr)
        .resolve("crossing.localhost", addr)
        .build()
        .unwrap();
    let call = |url: String, token: Option<String>| {
        let hosts = hosts.clone();
        async move {
            let mut request = hosts.get(url);
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            match request.send().await {
                Ok(response) => (response.status().as_u16(), response.text().await.unwrap()),
                Err(error) => (0, error.to_string()),
            }
        }
    };
    eventually(
        "the gateway to follow APIRules",
        Duration::from_secs(30),
        || async {
            call(format!("http://hello.localhost:{port}/greet?x=1"), None).await
                == (200, format!("/svc/{ns}/hello/80/greet"))
        },
    )
    .await
    .unwrap();
    let deleted = hosts
        .delete(format!("http://hello.localhost:{port}/greet"))
        .send()
        .await
        .unwrap();
    // No rule lists DELETE: no route, 404 (as Kyma's gateway answers).
    assert_eq!(deleted.status(), 404);
    let secured = format!("http://secured.example.com:{port}/orders");
    assert_eq!(
        call(secured.clone(), None).await,
        (403, "RBAC: access denied".to_owned())
    );
    assert_eq!(
        call(secured, Some(jwt(ISSUER_KEY, "key-1", json!({})))).await,
        (200, format!("/svc/{ns}/secured/8080/orders"))
    );
    // An APIRule crossing into another namespace (here toward the controller's API) routes
    // nothing: its host is no APIRule's, and the path names no function.
    let (status, body) = call(format!("http://crossing.localhost:{port}/apis"), None).await;
    assert_eq!(status, 404, "{body}");
    assert!(!body.contains("/svc/"), "{body}");

    // Kyma's extAuth docs, "Minimal configuration": "To use the extAuth access strategy,
    // you must first configure the authorizer in the Istio custom resource" (in kyma-system,
    // `spec.config.authorizers`). The controller and the gateway read it: the APIRule naming
    // it turns Ready, and calls are asked of it.
    let authorizer = serve_cookie_authorizer().await;
    let istio = format!(
        r#"apiVersion: operator.kyma-project.io/v1alpha2
kind: Istio
metadata: {{name: default, namespace: kyma-system}}
spec:
  config:
    authorizers:
      - name: oauth2-proxy
        service: 127.0.0.1
        port: {authorizer}
        headers:
          inCheck: {{include: [cookie]}}
          toUpstream: {{onAllow: [x-auth-request-user]}}
"#
    );
    run_with_input(
        cluster
            .plane
            .kubectl()
            .unwrap()
            .args(["apply", "--server-side", "-f", "-"]),
        &istio,
    )
    .unwrap();
    eventually(
        "the APIRule naming the Istio resource's authorizer Ready",
        Duration::from_secs(60),
        || async { state_of("outsourced").await.is_some_and(|s| s.0 == "Ready") },
    )
    .await
    .unwrap();
    let outsourced = reqwest::Client::builder()
        .resolve("outsourced.localhost", addr)
        .build()
        .unwrap();
    let ask = |cookie: Option<&'static str>| {
        let outsourced = outsourced.clone();
        async move {
            let mut request = outsourced.get(format!("http://outsourced.localhost:{port}/me"));
            if let Some(cookie) = cookie {
                request = request.header("cookie", cookie);
            }
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    eventually(
        "the gateway to ask the Istio resource's authorizer",
        Duration::from_secs(30),
        || async { ask(None).await == (401, "sign in".to_owned()) },
    )
    .await
    .unwrap();
    assert_eq!(
        ask(Some("session=ok")).await,
        (200, format!("/svc/{ns}/other/80/me"))
    );
    // Deleted, the authorizer is gone: the APIRule is an Error again, and routes nothing.
    run(cluster
        .plane
        .kubectl()
        .unwrap()
        .args(["delete", "istio", "default", "-n", "kyma-system"]))
    .unwrap();
    eventually(
        "the APIRule an Error once the Istio resource is gone",
        Duration::from_secs(60),
        || async {
            state_of("outsourced").await.is_some_and(|s| {
                s.0 == "Error" && s.1.contains("no extension provider \"oauth2-proxy\"")
            })
        },
    )
    .await
    .unwrap();
    // Its host routes nothing then (on Kyma, no VirtualService: 404).
    eventually(
        "the gateway to close it",
        Duration::from_secs(30),
        || async {
            let (status, body) = ask(Some("session=ok")).await;
            status == 404 && !body.contains("/svc/")
        },
    )
    .await
    .unwrap();
    cluster.assert_no_rbac_refusal();
    drop(gateway);
    drop(controller);
    cluster.finish().await;
}

/// Kyma's RateLimit on the real API server, under the chart's RBAC: the CRD takes Kyma's
/// samples as written; the controller reports Kyma's states (`Ready` "Finished
/// reconciliation"; `Warning` for one selecting pods an older one holds, and for one selecting
/// none, in Kyma's words; `Error` for a fill interval under 50ms); the gateway keeps the
/// buckets of the RateLimit holding a Kyma Function by its `spec.labels`, called through its
/// APIRule (429 `local_rate_limited` past them, `x-ratelimit-*` headers).
#[tokio::test]
async fn ratelimits_are_reported_by_the_controller_and_kept_by_the_gateway() {
    let _serial = serial().await;
    let cluster = Cluster::new("ratelimits").await;
    let ns = cluster.namespace.clone();
    let (controller, gateway, url) = kyma_controller_and_gateway(&cluster).await;
    // Kyma's "Path and header-based rate limit configuration" sample, on a Kyma Function
    // labelled as the docs' workload and exposed as the docs expose it (an APIRule).
    let yaml = format!(
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata:
  name: httpbin
  namespace: {ns}
spec:
  runtime: nodejs22
  labels:
    app: httpbin
  source:
    inline:
      source: |
        module.exports = {{ main: () => 'ok' }};
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata:
  name: httpbin
  namespace: {ns}
spec:
  hosts: [httpbin]
  gateway: kyma-system/kyma-gateway
  rules:
    - path: /*
      service: {{name: httpbin, port: 80}}
      methods: ["GET", "POST"]
      noAuth: true
---
{}"#,
        support::kyma::RATELIMIT_PATH_HEADER_SAMPLE
    );
    cluster.kubectl_apply(&yaml).unwrap();
    let limits = cluster.dynamic("gateway.kyma-project.io/v1alpha1", "RateLimit");
    let state_of = |name: &'static str| {
        let limits = limits.clone();
        async move {
            let limit = limits.get(name).await.ok()?;
            let status = limit.data.get("status")?.clone();
            Some((
                status["state"].as_str()?.to_owned(),
                status["description"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ))
        }
    };
    eventually("the RateLimit Ready", Duration::from_secs(60), || async {
        state_of("ratelimit-path-header-sample").await
            == Some(("Ready".to_owned(), "Finished reconciliation".to_owned()))
    })
    .await
    .unwrap();
    let more = format!(
        r#"apiVersion: gateway.kyma-project.io/v1alpha1
kind: RateLimit
metadata: {{name: second, namespace: {ns}}}
spec:
  selectorLabels: {{app: httpbin}}
  local: {{defaultBucket: {{maxTokens: 5, tokensPerFill: 5, fillInterval: 60s}}}}
---
apiVersion: gateway.kyma-project.io/v1alpha1
kind: RateLimit
metadata: {{name: nobody, namespace: {ns}}}
spec:
  selectorLabels: {{app: nobody}}
  local: {{defaultBucket: {{maxTokens: 5, tokensPerFill: 5, fillInterval: 60s}}}}
---
apiVersion: gateway.kyma-project.io/v1alpha1
kind: RateLimit
metadata: {{name: hasty, namespace: {ns}}}
spec:
  selectorLabels: {{app: hasty}}
  local: {{defaultBucket: {{maxTokens: 5, tokensPerFill: 5, fillInterval: 10ms}}}}
"#
    );
    cluster.kubectl_apply(&more).unwrap();
    eventually("the others' states", Duration::from_secs(60), || async {
        state_of("second").await
            == Some((
                "Warning".to_owned(),
                "conflicting with the following RateLimit CRs: ratelimit-path-header-sample"
                    .to_owned(),
            ))
            && state_of("nobody").await
                == Some((
                    "Warning".to_owned(),
                    format!(
                        "no pods found with the given selectors: map[app:nobody] in namespace {ns}"
                    ),
                ))
            && state_of("hasty").await
                == Some((
                    "Error".to_owned(),
                    "defaultBucket: fillInterval must be greater or equal 50ms".to_owned(),
                ))
    })
    .await
    .unwrap();

    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let http = reqwest::Client::builder()
        .resolve("httpbin.localhost", addr)
        .build()
        .unwrap();
    let port = addr.port();
    let get = |path: &'static str, flagged: bool| {
        let (http, url) = (
            http.clone(),
            format!("http://httpbin.localhost:{port}{path}"),
        );
        async move {
            let answer = support::rate_limited_get(&http, url, flagged).await;
            (answer.status, answer.limits, answer.body)
        }
    };
    eventually(
        "the gateway to keep the buckets",
        Duration::from_secs(30),
        || async { get("/headers", true).await.1.0 == "10" },
    )
    .await
    .unwrap();
    let (status, limits, body) = get("/headers", false).await;
    assert_eq!(
        (status, body),
        (200, format!("/svc/{ns}/httpbin/80/headers"))
    );
    assert_eq!(limits, ("1".to_owned(), "0".to_owned()));
    let (status, limits, body) = get("/ip", true).await;
    assert_eq!((status, body.as_str()), (429, "local_rate_limited"));
    assert_eq!(limits, ("1".to_owned(), "0".to_owned()));
    cluster.assert_no_rbac_refusal();
    drop(gateway);
    drop(controller);
    cluster.finish().await;
}

/// The chart's controller and gateway as processes (Kyma's Istio CRD stood in for, as a Kyma
/// cluster has it from its Istio module), the gateway's calls answered by
/// [`function_services`] (`/fn/<namespace>/<function>/...`, `/svc/<namespace>/<service>/<port>/...`);
/// and the gateway's URL.
async fn kyma_controller_and_gateway(cluster: &Cluster) -> (Component, Component, String) {
    install_kyma_istio_crd(cluster);
    let controller = cluster.controller().await;
    let services = function_services().await;
    let function_url = format!("{services}/fn/{{namespace}}/{{function}}");
    let service_url = format!("{services}/svc/{{namespace}}/{{service}}/{{port}}");
    let gateway = cluster
        .component(
            "gateway",
            &[
                ("EDDY_GATEWAY_ADDR", "127.0.0.1:0"),
                ("EDDY_FUNCTION_URL", &function_url),
                ("EDDY_SERVICE_URL", &service_url),
            ],
        )
        .await;
    let url = gateway.url().await;
    (controller, gateway, url)
}

/// A stand-in for Kyma's Istio CRD (`istios.operator.kyma-project.io`, the Istio module's),
/// and the `kyma-system` namespace the Istio resource lives in.
pub(crate) fn install_kyma_istio_crd(cluster: &Cluster) {
    let crd = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: istios.operator.kyma-project.io}
spec:
  group: operator.kyma-project.io
  scope: Namespaced
  names: {kind: Istio, plural: istios, singular: istio, listKind: IstioList}
  versions:
    - name: v1alpha2
      served: true
      storage: true
      subresources: {status: {}}
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
---
apiVersion: v1
kind: Namespace
metadata: {name: kyma-system}
"#;
    let kubectl = || cluster.plane.kubectl().unwrap();
    run_with_input(kubectl().args(["apply", "--server-side", "-f", "-"]), crd).unwrap();
    run(kubectl().args([
        "wait",
        "--for=condition=established",
        "--timeout=30s",
        "crd/istios.operator.kyma-project.io",
    ]))
    .unwrap();
}

/// An external authorizer that lets a call through when it carries `session=ok` (saying who
/// with `x-auth-request-user`), and otherwise answers 401 `sign in`. Its port.
pub(crate) async fn serve_cookie_authorizer() -> u16 {
    use axum::response::IntoResponse as _;
    let app = axum::Router::new().fallback(|headers: http::HeaderMap| async move {
        let signed_in = headers
            .get("cookie")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|cookie| cookie.contains("session=ok"));
        if signed_in {
            ([("x-auth-request-user", "ada")], "").into_response()
        } else {
            (http::StatusCode::UNAUTHORIZED, "sign in").into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}
