//! The gateway: routes by the Functions it reads, with their access enforced.

use super::*;

/// Stands in for every function Service (the gateway's `--function-url` points here): answers
/// with the path it was asked for.
pub(crate) async fn function_services() -> String {
    let app = axum::Router::new()
        .fallback(|request: axum::extract::Request| async move { request.uri().path().to_owned() });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// The chart's gateway with its function URLs pointed at `services`.
pub(crate) async fn gateway(cluster: &Cluster, services: &str) -> (Component, String) {
    let function_url = format!("{services}/svc/{{namespace}}/{{function}}");
    let gateway = cluster
        .component(
            "gateway",
            &[
                ("EDDY_GATEWAY_ADDR", "127.0.0.1:0"),
                ("EDDY_FUNCTION_URL", &function_url),
            ],
        )
        .await;
    let url = gateway.url().await;
    let http = reqwest::Client::new();
    eventually(
        "the gateway to list Functions",
        Duration::from_secs(30),
        || async {
            http.get(format!("{url}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await
    .unwrap();
    (gateway, url)
}

/// GET `url` with an optional bearer token: (status, body).
pub(crate) async fn call(url: &str, token: Option<&str>) -> (u16, String) {
    let mut request = reqwest::Client::new().get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    match request.send().await {
        Ok(response) => (
            response.status().as_u16(),
            response.text().await.unwrap_or_default(),
        ),
        Err(error) => (0, error.to_string()),
    }
}

pub(crate) fn with_access(name: &str, access: Value) -> Value {
    let mut spec = inline("module.exports = {main: () => 1}");
    spec["access"] = access;
    function(name, spec)
}

/// The chart's gateway reads Functions from the API server (under its ClusterRole): 404 for one
/// that does not exist, `access` enforced, and it follows changes and deletions.
#[tokio::test]
async fn the_gateway_routes_by_the_functions_it_reads_and_enforces_access() {
    let _serial = serial().await;
    let cluster = Cluster::new("gateway").await;
    let ns = cluster.namespace.clone();
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let apply = PatchParams::apply("test");
    let digest = eddy_platform::auth::Tokens::digest_text("vault-token");
    functions
        .patch(
            "hello",
            &apply,
            &Patch::Apply(with_access("hello", json!({"mode": "public"}))),
        )
        .await
        .unwrap();
    functions
        .patch(
            "vault",
            &apply,
            &Patch::Apply(with_access(
                "vault",
                json!({"mode": "token", "tokenDigests": [digest]}),
            )),
        )
        .await
        .unwrap();
    let (gateway, url) = gateway(&cluster, &function_services().await).await;

    assert_eq!(
        call(&format!("{url}/{ns}/hello/a?b=c"), None).await,
        (200, format!("/svc/{ns}/hello/a"))
    );
    let (status, body) = call(&format!("{url}/{ns}/nobody/"), None).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body.contains(&format!("function {ns}/nobody not found")),
        "{body}"
    );
    assert_eq!(call(&format!("{url}/{ns}/vault/"), None).await.0, 401);
    assert_eq!(
        call(&format!("{url}/{ns}/vault/"), Some("other")).await.0,
        401
    );
    assert_eq!(
        call(&format!("{url}/{ns}/vault/"), Some("vault-token")).await,
        (200, format!("/svc/{ns}/vault/"))
    );

    // Changes and deletions are followed.
    functions
        .patch(
            "hello",
            &apply,
            &Patch::Apply(with_access(
                "hello",
                json!({"mode": "token", "tokenDigests": [digest]}),
            )),
        )
        .await
        .unwrap();
    functions
        .delete("vault", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the gateway to follow", Duration::from_secs(30), || async {
        call(&format!("{url}/{ns}/hello/"), None).await.0 == 401
            && call(&format!("{url}/{ns}/vault/"), Some("vault-token"))
                .await
                .0
                == 404
    })
    .await
    .unwrap();
    cluster.assert_no_rbac_refusal();
    drop(gateway);
    cluster.finish().await;
}
