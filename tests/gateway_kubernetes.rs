//! eddy's gateway on Kubernetes (`eddy gateway`): Functions from the API (a mock API server:
//! one list, then watch events the test sends), calls forwarded to the function Services (a
//! local server standing in for them, through `--function-url`), `spec.access` enforced.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use eddy_gateway::kubernetes::{self as gateway, GatewayArgs};
use eddy_testing::{eventually, kube_mock};
use serde_json::{Value, json};

fn function(name: &str, access: Value, resource_version: &str) -> Value {
    json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": name, "namespace": "shop", "uid": name, "resourceVersion": resource_version},
        "spec": {"runtime": "nodejs22", "source": {"inline": {"source": "x"}}, "access": access},
    })
}

/// Stands in for every function Service: answers with what it was asked.
async fn services() -> String {
    let app = axum::Router::new().fallback(|request: axum::extract::Request| async move {
        let host = request
            .headers()
            .get("x-forwarded-host")
            .map(|v| v.to_str().unwrap().to_owned());
        let authorization = request.headers().get("authorization").is_some();
        axum::Json(json!({
            "method": request.method().as_str(),
            "uri": request.uri().to_string(),
            "forwardedHost": host,
            "authorization": authorization,
        }))
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_routes_to_function_services_and_enforces_access() {
    let digest = eddy_platform::auth::Tokens::digest_text("vault-token");
    let (client, watch, requests) = kube_mock::api_server(
        "/apis/eddy.dev/v1alpha1/functions?",
        "FunctionList",
        vec![
            function("hello", json!({"mode": "public"}), "1"),
            function(
                "vault",
                json!({"mode": "token", "tokenDigests": [digest]}),
                "1",
            ),
        ],
    );
    let services = services().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut args: GatewayArgs = eddy_platform::flags::defaults();
    // Every Service is the stand-in; the path tells which function was meant.
    args.function_url = format!("{services}/svc/{{namespace}}/{{function}}");
    let shutdown = eddy_platform::shutdown::CancellationToken::new();
    tokio::spawn(gateway::serve_on(listener, args, client, shutdown.clone()));
    let http = reqwest::Client::new();

    eventually(
        "the gateway to list Functions",
        Duration::from_secs(10),
        || async {
            http.get(format!("{url}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await
    .unwrap();

    let answer = http
        .post(format!("{url}/shop/hello/orders/7?expand=lines"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let seen: Value = answer.json().await.unwrap();
    assert_eq!(seen["method"], "POST");
    assert_eq!(
        seen["uri"], "/svc/shop/hello/orders/7?expand=lines",
        "{seen}"
    );
    assert!(
        seen["forwardedHost"]
            .as_str()
            .unwrap()
            .starts_with("127.0.0.1:"),
        "{seen}"
    );

    let refused = http.get(format!("{url}/shop/vault/")).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    assert_eq!(refused.headers()["www-authenticate"], "Bearer");
    let wrong = http
        .get(format!("{url}/shop/vault/"))
        .bearer_auth("other")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let allowed = http
        .get(format!("{url}/shop/vault/"))
        .bearer_auth("vault-token")
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status(), 200);
    let seen: Value = allowed.json().await.unwrap();
    assert_eq!(seen["uri"], "/svc/shop/vault/");
    assert_eq!(
        seen["authorization"], true,
        "the caller's token reaches the function"
    );

    let missing = http
        .get(format!("{url}/shop/nothing"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let body: Value = missing.json().await.unwrap();
    assert!(body.to_string().contains("shop/nothing"), "{body}");
    assert_eq!(
        http.get(format!("{url}/")).send().await.unwrap().status(),
        404
    );

    // Calls counted per function by status class: hello 200 once; vault 401 twice, 200 once.
    let metrics = metrics_of(&http, &url).await;
    for line in [
        r#"eddy_function_calls_total{namespace="shop",function="hello",status_class="2xx"} 1"#,
        r#"eddy_function_calls_total{namespace="shop",function="vault",status_class="4xx"} 2"#,
        r#"eddy_function_calls_total{namespace="shop",function="vault",status_class="2xx"} 1"#,
        r#"eddy_function_duration_seconds_count{namespace="shop",function="vault"} 3"#,
        r#"eddy_function_errors_total{namespace="shop",function="vault"} 0"#,
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    assert!(
        !metrics.contains(r#"function="nothing""#),
        "no series for a function that does not exist"
    );

    // A Function added, one made public, one deleted: followed from the watch.
    watch
        .send(json!({"type": "ADDED", "object": function("late", json!({"mode": "public"}), "2")}))
        .await
        .unwrap();
    watch
        .send(json!({"type": "MODIFIED", "object": function("vault", json!({"mode": "public"}), "3")}))
        .await
        .unwrap();
    watch
        .send(
            json!({"type": "DELETED", "object": function("hello", json!({"mode": "public"}), "4")}),
        )
        .await
        .unwrap();
    let status = |path: &'static str| {
        let request = http.get(format!("{url}{path}"));
        async move {
            request
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }
    };
    eventually(
        "the watch events to be followed",
        Duration::from_secs(10),
        || async {
            status("/shop/late/").await == 200
                && status("/shop/vault/").await == 200
                && status("/shop/hello/").await == 404
        },
    )
    .await
    .unwrap();
    let metrics = metrics_of(&http, &url).await;
    assert!(
        !metrics.contains(r#"function="hello""#),
        "a deleted Function's series go with it:\n{metrics}"
    );

    shutdown.cancel();
    // The gateway lists and watches Functions, as its ClusterRole in the chart allows. The
    // chart also lets it wake Functions that scale to zero (a Deployment's scale) and renew
    // their calls Leases, which none of these Functions does: the real-pod tests exercise
    // those grants (tests/real_pods/scale.rs).
    let waking = [
        "apps/deployments/scale:get",
        "apps/deployments/scale:update",
        "coordination.k8s.io/leases:create",
        "coordination.k8s.io/leases:patch",
    ];
    let made: std::collections::BTreeSet<String> = requests
        .lock()
        .unwrap()
        .iter()
        .flat_map(|(method, uri)| eddy_testing::rbac::needed_by(method, uri))
        .chain(waking.map(str::to_owned))
        .collect();
    let rendered = eddy_testing::rbac::rendered("gateway.yaml", &[]).unwrap();
    assert_eq!(made, eddy_testing::rbac::granted_by_cluster_role(&rendered));
}

/// The gateway's `/metrics` text.
async fn metrics_of(http: &reqwest::Client, url: &str) -> String {
    http.get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_function_service_that_does_not_answer_gets_502() {
    let (client, _watch, _) = kube_mock::api_server(
        "/apis/eddy.dev/v1alpha1/functions?",
        "FunctionList",
        vec![function("gone", json!({"mode": "public"}), "1")],
    );
    // Nothing listens here.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut args: GatewayArgs = eddy_platform::flags::defaults();
    args.function_url = format!("{dead}/{{function}}");
    let shutdown = eddy_platform::shutdown::CancellationToken::new();
    tokio::spawn(gateway::serve_on(listener, args, client, shutdown.clone()));
    let http = reqwest::Client::new();
    eventually(
        "a 502 from the gateway",
        Duration::from_secs(10),
        || async {
            http.get(format!("{url}/shop/gone/"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 502)
        },
    )
    .await
    .unwrap();
    shutdown.cancel();
}

/// A function Service that takes the call but never answers gets 504 from the gateway at the
/// Function's `timeoutSeconds` plus 5 s, not sooner and not much later.
#[tokio::test]
async fn a_function_service_that_never_answers_gets_504_after_its_timeout_and_five_seconds() {
    let mut stuck = function("stuck", json!({"mode": "public"}), "1");
    stuck["spec"]["timeoutSeconds"] = json!(1);
    let (client, _watch, _) = kube_mock::api_server(
        "/apis/eddy.dev/v1alpha1/functions?",
        "FunctionList",
        vec![stuck],
    );
    // Accepts connections and reads the request, but never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            held.push(connection);
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut args: GatewayArgs = eddy_platform::flags::defaults();
    args.function_url = format!("{silent_url}/{{function}}");
    let shutdown = eddy_platform::shutdown::CancellationToken::new();
    tokio::spawn(gateway::serve_on(listener, args, client, shutdown.clone()));
    let http = reqwest::Client::new();
    // Ready once the Functions are listed.
    eventually("the gateway ready", Duration::from_secs(10), || async {
        http.get(format!("{url}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let response = http
        .get(format!("{url}/shop/stuck/"))
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(response.status(), 504);
    assert!(
        waited >= Duration::from_millis(5_900) && waited < Duration::from_secs(8),
        "answered after {waited:?}, not at the 1 s timeout plus 5 s"
    );
    shutdown.cancel();
}

#[test]
fn upstream_uris_keep_the_path_and_query() {
    let uri = gateway::upstream_uri(
        "http://{function}.{namespace}.svc.cluster.local",
        "shop",
        "hello",
        "/a/b?c=d",
    )
    .unwrap();
    assert_eq!(
        uri.to_string(),
        "http://hello.shop.svc.cluster.local/a/b?c=d"
    );
    let root =
        gateway::upstream_uri("http://{function}.{namespace}/", "shop", "hello", "/").unwrap();
    assert_eq!(root.to_string(), "http://hello.shop/");
}
