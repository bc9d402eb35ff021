//! Who gets in: API tokens on the controller API, the dashboard and the dispatcher's admin API;
//! paths and headers that try to reach another function or break the gateway.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use eddy_testing::{NatsServer, eventually};
use serde_json::json;
use support::{
    Platform,
    jwt::{ISSUER, ISSUER_KEY, OTHER_KEY, jwt, jwt_with_crit, now_seconds, serve_jwks},
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const TOKEN: &str = "s3cret-token";

async fn listener() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    (listener, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_tokens_guard_the_controller_api_the_dashboard_and_the_dispatcher_admin() {
    let nats = NatsServer::start().unwrap();
    let shutdown = eddy_platform::shutdown::CancellationToken::new();
    let (api_listener, api) = listener().await;
    let (gateway_listener, gateway) = listener().await;
    let (dispatcher_listener, dispatcher) = listener().await;
    let data_dir = tempfile::tempdir().unwrap();
    let mut args = eddy_controller::Args::new(api_listener.local_addr().unwrap(), nats.url());
    args.local.data_dir = data_dir.path().to_path_buf();
    args.api_auth.api_tokens = vec![TOKEN.to_owned()];
    let controller = eddy::local::Controller::new(args, gateway, shutdown.child_token())
        .await
        .unwrap();
    tokio::spawn(controller.serve(api_listener, gateway_listener));
    let mut args =
        eddy_dispatcher::Args::new(dispatcher_listener.local_addr().unwrap(), nats.url());
    args.api_auth.api_tokens = vec![TOKEN.to_owned()];
    let admin = eddy_dispatcher::Dispatcher::new(args, shutdown.child_token())
        .await
        .unwrap();
    tokio::spawn(admin.serve(dispatcher_listener));

    let http = reqwest::Client::new();
    let get = |url: String, token: Option<&str>| {
        let mut request = http.get(url);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move { request.send().await.unwrap() }
    };
    let functions = format!("{api}/apis/eddy.dev/v1alpha1/namespaces/default/functions");

    let refused = get(functions.clone(), None).await;
    assert_eq!(refused.status(), 401);
    assert_eq!(refused.headers()["www-authenticate"], "Bearer");
    assert_eq!(get(functions.clone(), Some("wrong")).await.status(), 401);
    assert_eq!(get(functions.clone(), Some(TOKEN)).await.status(), 200);
    assert_eq!(
        get(format!("{api}/healthz"), None).await.status(),
        200,
        "probes stay open"
    );

    // Writes need the header; a token in the query only opens GETs (the dashboard in a browser).
    let function = json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Function",
        "metadata": {"name": "f", "namespace": "default"},
        "spec": {"runtime": "nodejs20", "source": {"inline": {"source": "x"}}},
    });
    let put = http
        .put(format!("{functions}/f?token={TOKEN}"))
        .json(&function)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 401);
    // The page holds no data: it is served to anyone and asks for the token itself.
    let page = get(format!("{api}/"), None).await;
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("token-dialog"));
    assert_eq!(
        get(format!("{api}/dashboard/events"), None).await.status(),
        401
    );
    // `?token=` opens the live tail only (a browser EventSource cannot set headers): not the
    // rest of the API, the dashboard's other data or the dispatcher's admin API.
    // Past the token check (the tail itself answers 503 here: no events stream yet).
    assert_ne!(
        get(format!("{api}/dashboard/events?token={TOKEN}"), None)
            .await
            .status(),
        401
    );
    assert_eq!(
        get(format!("{api}/dashboard/events?token=nope"), None)
            .await
            .status(),
        401
    );
    for url in [
        format!("{api}/dashboard/state?token={TOKEN}"),
        format!("{functions}?token={TOKEN}"),
        format!("{api}/api/v1/namespaces/default/secrets?token={TOKEN}"),
        format!("{dispatcher}/dead-letters?token={TOKEN}"),
    ] {
        assert_eq!(get(url.clone(), None).await.status(), 401, "{url}");
    }

    assert_eq!(
        get(format!("{dispatcher}/dead-letters"), None)
            .await
            .status(),
        401
    );
    assert_eq!(
        get(format!("{dispatcher}/dead-letters"), Some(TOKEN))
            .await
            .status(),
        200
    );
    assert_eq!(
        get(format!("{dispatcher}/healthz"), None).await.status(),
        200
    );

    // The CLI sends --token / EDDY_TOKEN.
    let eddy = |token: Option<&str>| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_eddy"));
        command.args(["get", "functions", "--server", &api]);
        command.env_remove("EDDY_TOKEN");
        if let Some(token) = token {
            command.env("EDDY_TOKEN", token);
        }
        command.output()
    };
    let without = eddy(None).await.unwrap();
    assert!(!without.status.success());
    assert!(
        String::from_utf8_lossy(&without.stderr).contains("a valid bearer token is required"),
        "{without:?}"
    );
    let with = eddy(Some(TOKEN)).await.unwrap();
    assert!(with.status.success(), "{with:?}");
    shutdown.cancel();
}

/// Sends raw bytes (so nothing normalizes the path) and returns the status code and body.
async fn raw(addr: &str, request: &[u8]) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr.trim_start_matches("http://"))
        .await
        .unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    (status, text)
}

const ECHO: &str = r#"
module.exports = {
  main: (event, context) => ({ function: context["function-name"], path: event.extensions.request.url }),
};
"#;

#[tokio::test]
async fn gateway_paths_and_headers_cannot_reach_another_function_or_break_the_gateway() {
    let platform = Platform::start().await;
    let spec = json!({"runtime": "nodejs20", "source": {"inline": {"source": ECHO}}});
    platform.deploy("front", spec.clone()).await;
    platform.deploy("back", spec).await;
    let gateway = platform.gateway.clone();
    let get = |path: &str| {
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").into_bytes()
    };

    // Paths are normalised as Istio's gateway normalises them, before any routing: dot
    // segments resolved (plain or percent-encoded), so a route or rule sees the path the
    // Function gets; an encoded slash is refused rather than left for a later reader to split.
    for (path, function, seen) in [
        ("/default/front/../back/x", "back", "/x"),
        ("/default/front/%2e%2e/back", "back", "/"),
        ("/default/front/.%2E/back/", "back", "/"),
        ("/default/front/./x", "front", "/x"),
        ("/default//front///%78", "front", "/x"),
    ] {
        let (status, text) = raw(&gateway, &get(path)).await;
        assert_eq!(status, 200, "{path}: {text}");
        assert!(
            text.contains(&format!(r#""function":"{function}","path":"{seen}""#)),
            "{path}: {text}"
        );
    }
    // Refused before routing: encoded separators; names that are not DNS labels never select
    // a function.
    for (path, status_wanted) in [
        ("/default/front/a%2Fb", 400),
        ("/default/..%2Fback/x", 400),
        ("/default/front%2F..%2Fback", 400),
        ("/default%2Fx/back", 400),
        ("/default/front/%zz", 400),
        ("/default/BACK", 404),
    ] {
        let (status, text) = raw(&gateway, &get(path)).await;
        assert_eq!(status, status_wanted, "{path}: {text}");
        assert!(!text.contains(r#""function""#), "{path}: {text}");
    }
    // A header value with a bare CR or LF, an oversized header block: refused, nothing crashes.
    let (status, _) = raw(
        &gateway,
        b"GET /default/front/ HTTP/1.1\r\nHost: localhost\r\nX-Test: a\rInjected: yes\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 400);
    let huge = format!(
        "GET /default/front/ HTTP/1.1\r\nHost: localhost\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
        "a".repeat(1 << 20)
    );
    let (status, _) = raw(&gateway, huge.as_bytes()).await;
    assert!(status == 431 || status == 400, "{status}");
    let many: String = (0..500).map(|i| format!("X-H{i}: v\r\n")).collect();
    let (status, _) = raw(
        &gateway,
        format!(
            "GET /default/front/ HTTP/1.1\r\nHost: localhost\r\n{many}Connection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert!(status == 431 || status == 400, "{status}");
    // And the gateway still serves.
    let (status, text) = raw(&gateway, &get("/default/back/ok")).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains(r#""function":"back""#));
    // A caller's own X-Forwarded-Client-Cert never reaches a Function: in the mesh, its
    // sidecar appends the gateway's identity after whatever came, and a Function reading the
    // first entry would take the caller for the dispatcher.
    let headers = "module.exports = { main: (event) => ({ xfcc: event.extensions.request.headers['x-forwarded-client-cert'] || null }) };";
    platform
        .deploy(
            "headers",
            json!({"runtime": "nodejs20", "source": {"inline": {"source": headers}}}),
        )
        .await;
    let (status, text) = raw(
        &gateway,
        b"GET /default/headers/ HTTP/1.1\r\nHost: localhost\r\nX-Forwarded-Client-Cert: By=spiffe://cluster.local/ns/x/sa/y;URI=spiffe://cluster.local/ns/eddy-system/sa/eddy-dispatcher\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains(r#"{"xfcc":null}"#), "{text}");
}

const GUARDED: &str = r#"
const seen = [];
module.exports = {
  main: (event) => {
    if (event["ce-id"]) { seen.push(event["ce-id"]); return "ok"; }
    return { seen };
  },
};
"#;

/// `access.mode: token`: callers need a listed token, the platform's dispatcher still
/// delivers, and switching back to public needs no rebuild.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_protected_function_takes_only_its_tokens_and_the_dispatchers_events() {
    let platform = Platform::start().await;
    let digest = eddy_platform::auth::Tokens::digest_text("caller-token");
    let guarded = |access: serde_json::Value| json!({"runtime": "nodejs20", "source": {"inline": {"source": GUARDED}}, "access": access});
    platform
        .deploy(
            "guarded",
            guarded(json!({"mode": "token", "tokenDigests": [digest]})),
        )
        .await;

    let refused = platform.invoke("guarded", "/").send().await.unwrap();
    assert_eq!(refused.status(), 401);
    assert_eq!(refused.headers()["www-authenticate"], "Bearer");
    let wrong = platform
        .invoke("guarded", "/")
        .bearer_auth("other")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let allowed = platform
        .invoke("guarded", "/")
        .bearer_auth("caller-token")
        .send()
        .await
        .unwrap();
    assert_eq!(allowed.status(), 200);

    // The dispatcher delivers to it with the platform's token.
    platform
        .subscribe(
            "to-guarded",
            json!({"sink": "http://guarded.default.svc.cluster.local", "types": ["order.created.v1"]}),
        )
        .await;
    platform
        .publish("shop", "order.created.v1", "o-1", json!({}))
        .await;
    platform.wait_settled("to-guarded").await;
    let seen: serde_json::Value = platform
        .invoke("guarded", "/")
        .bearer_auth("caller-token")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(seen["seen"], json!(["o-1"]), "{seen}");
    assert!(platform.dead_letters("to-guarded").await.is_empty());

    // Public again: the same build and the same instance, no token needed.
    let build = platform.condition("guarded", "BuildReady").await;
    let instances = platform.pids("guarded");
    platform
        .deploy("guarded", guarded(json!({"mode": "public"})))
        .await;
    let open = platform.invoke("guarded", "/").send().await.unwrap();
    assert_eq!(open.status(), 200);
    let (_, _, built) = build;
    assert_eq!(
        platform.condition("guarded", "BuildReady").await,
        ("True".to_owned(), "BuildReused".to_owned(), built),
        "the same build, reused"
    );
    assert_eq!(platform.pids("guarded"), instances, "not restarted");
}

/// Test-only P-256 keys: the issuer's, and one the issuer never published.
/// JWT access as Kyma's APIRule offers it: a valid token from the issuer gets in (200); an
/// expired one, one not valid yet, one from another issuer or audience or without `aud`, one
/// with a critical header extension, one signed with a key the issuer never
/// published, an HMAC one and none at all get 401; a valid one without the required claim
/// gets 403. The issuer's keys are fetched once and reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwt_protected_function_takes_only_valid_tokens_of_its_issuer() {
    let (jwks_uri, fetches) = serve_jwks().await;
    let platform = Platform::start().await;
    platform
        .deploy(
            "jwt-guarded",
            json!({"runtime": "nodejs20", "source": {"inline": {"source": GUARDED}}, "access": {
                "mode": "jwt",
                "jwt": {"issuer": ISSUER, "jwksUri": jwks_uri, "audiences": ["orders"],
                        "requiredClaims": {"scope": "orders:write"}},
            }}),
        )
        .await;
    let call = |token: Option<String>| {
        let mut request = platform.invoke("jwt-guarded", "/");
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let challenge = response
                .headers()
                .get("www-authenticate")
                .map(|v| v.to_str().unwrap().to_owned());
            (status, challenge, response.text().await.unwrap())
        }
    };

    let (status, _, body) = call(Some(jwt(ISSUER_KEY, "key-1", json!({})))).await;
    assert_eq!(status, 200, "a valid token: {body}");

    let expired = jwt(ISSUER_KEY, "key-1", json!({"exp": now_seconds() - 120}));
    let (status, challenge, body) = call(Some(expired)).await;
    assert_eq!(
        (status, challenge.as_deref()),
        (401, Some("Bearer")),
        "{body}"
    );
    assert!(body.contains("expired"), "{body}");

    let (status, _, body) = call(Some(jwt(
        ISSUER_KEY,
        "key-1",
        json!({"iss": "https://evil.example.com/"}),
    )))
    .await;
    assert_eq!(status, 401, "another issuer: {body}");
    assert!(body.contains("another issuer"), "{body}");

    let (status, _, body) = call(Some(jwt(ISSUER_KEY, "key-1", json!({"aud": "billing"})))).await;
    assert_eq!(status, 401, "another audience: {body}");
    // Audiences are configured: a token for no audience in particular is not for this one.
    let (status, _, body) = call(Some(jwt(ISSUER_KEY, "key-1", json!({"aud": null})))).await;
    assert_eq!(status, 401, "no aud: {body}");
    assert!(body.contains("lacks aud"), "{body}");

    // Not valid yet (nbf), beyond the 30 s leeway: refused; within it: let in.
    let early = jwt(ISSUER_KEY, "key-1", json!({"nbf": now_seconds() + 600}));
    let (status, _, body) = call(Some(early)).await;
    assert_eq!(status, 401, "nbf in ten minutes: {body}");
    assert!(body.contains("not valid yet"), "{body}");
    let skewed = jwt(ISSUER_KEY, "key-1", json!({"nbf": now_seconds() + 10}));
    let (status, _, body) = call(Some(skewed)).await;
    assert_eq!(status, 200, "nbf within the leeway: {body}");

    // A critical header extension eddy does not understand (RFC 7515 4.1.11).
    let critical = jwt_with_crit(
        ISSUER_KEY,
        "key-1",
        json!({}),
        Some(vec!["exp-ext".to_owned()]),
    );
    let (status, _, body) = call(Some(critical)).await;
    assert_eq!(status, 401, "crit: {body}");
    assert!(body.contains("crit"), "{body}");

    let (status, _, body) = call(Some(jwt(
        ISSUER_KEY,
        "key-1",
        json!({"scope": "orders:read"}),
    )))
    .await;
    assert_eq!(status, 403, "no orders:write scope: {body}");
    assert!(body.contains("scope"), "{body}");

    let (status, _, body) = call(Some(jwt(OTHER_KEY, "key-2", json!({})))).await;
    assert_eq!(status, 401, "a key the issuer never published: {body}");
    let (status, _, body) = call(Some(jwt(OTHER_KEY, "key-1", json!({})))).await;
    assert_eq!(status, 401, "another key under the issuer's key id: {body}");
    assert!(body.contains("signature"), "{body}");

    let hmac = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &json!({"iss": ISSUER, "aud": "orders", "exp": now_seconds() + 300, "scope": "orders:write"}),
        &jsonwebtoken::EncodingKey::from_secret(b"guessable"),
    )
    .unwrap();
    let (status, _, body) = call(Some(hmac)).await;
    assert_eq!(status, 401, "an HMAC token: {body}");

    let (status, challenge, _) = call(None).await;
    assert_eq!((status, challenge.as_deref()), (401, Some("Bearer")));
    let (status, _, _) = call(Some("not-a-jwt".to_owned())).await;
    assert_eq!(status, 401);

    assert_eq!(
        fetches.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the keys are fetched once (an unknown key id refetches at most every 10 s)"
    );
    let (status, _, _) = call(Some(jwt(ISSUER_KEY, "key-1", json!({})))).await;
    assert_eq!(status, 200, "still let in");
}

/// A cold-started instance (no warm spare) gets its instance secret and publish token on
/// stdin, not in its environment: /proc/<pid>/environ, which every process of the same user
/// can read (another function's included), shows neither, and the instance still answers
/// through the gateway (it has its secret). Both runtimes.
#[tokio::test]
async fn a_cold_instance_keeps_its_secrets_out_of_its_environment() {
    let platform = Platform::start_with(support::Options {
        warm_spares: 0,
        ..support::Options::default()
    })
    .await;
    for (name, runtime, source) in [
        (
            "cold-node",
            "nodejs20",
            "module.exports = {main: () => 'ok'}",
        ),
        (
            "cold-python",
            "python311",
            "def main(event, context):\n    return 'ok'\n",
        ),
    ] {
        platform
            .deploy(
                name,
                json!({"runtime": runtime, "source": {"inline": {"source": source}}}),
            )
            .await;
        let response = platform.invoke(name, "/").send().await.unwrap();
        assert_eq!(response.status(), 200, "{name}");
        let pids = platform.pids(name);
        assert!(!pids.is_empty(), "{name} runs");
        for pid in pids {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
            let environ = String::from_utf8_lossy(&environ);
            assert!(
                environ.contains(&format!("FUNC_NAME={name}")),
                "{name}: {environ}"
            );
            for secret in ["EDDY_INSTANCE_SECRET", "EDDY_PUBLISHER_TOKEN"] {
                assert!(
                    !environ.contains(secret),
                    "{name}'s environment holds {secret}"
                );
            }
        }
    }
}

/// The issuer's keys over time: with none fetched yet and the issuer down, calls get 503; once
/// it answers, its keys serve; a rotated key (a token naming a key id the held set lacks) is
/// fetched without a restart (at most every 10 s); and while the issuer is down again, the keys
/// fetched before keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_keys_are_fetched_rotated_and_kept_while_the_issuer_is_down() {
    use axum::response::IntoResponse as _;
    use jsonwebtoken::{Algorithm, EncodingKey, jwk::Jwk};
    use std::sync::{Arc, Mutex};
    let jwk = |pem: &str, kid: &str| {
        let key = EncodingKey::from_ec_pem(pem.as_bytes()).unwrap();
        let mut jwk = Jwk::from_encoding_key(&key, Algorithm::ES256).unwrap();
        jwk.common.key_id = Some(kid.to_owned());
        json!({"keys": [jwk]})
    };
    // `None`: the issuer is down (503).
    let published: Arc<Mutex<Option<serde_json::Value>>> = Arc::default();
    let serving = published.clone();
    let app = axum::Router::new().route(
        "/jwks",
        axum::routing::get(move || {
            let document = serving.lock().unwrap().clone();
            async move {
                match document {
                    Some(document) => axum::Json(document).into_response(),
                    None => axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response(),
                }
            }
        }),
    );
    let (listener, url) = listener().await;
    tokio::spawn(async move { axum::serve(listener, app).await });
    let platform = Platform::start().await;
    platform
        .deploy(
            "rotating",
            json!({"runtime": "nodejs20", "source": {"inline": {"source": GUARDED}}, "access": {
                "mode": "jwt", "jwt": {"issuer": ISSUER, "jwksUri": format!("{url}/jwks")},
            }}),
        )
        .await;
    let call = |token: String| {
        let request = platform.invoke("rotating", "/").bearer_auth(token);
        async move {
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    let first = || jwt(ISSUER_KEY, "key-1", json!({}));
    let second = || jwt(OTHER_KEY, "key-2", json!({}));

    let (status, body) = call(first()).await;
    assert_eq!(status, 503, "no keys yet, the issuer down: {body}");

    *published.lock().unwrap() = Some(jwk(ISSUER_KEY, "key-1"));
    let (status, body) = call(first()).await;
    assert_eq!(status, 200, "the issuer's key: {body}");

    // Rotation: the issuer now publishes key-2 only.
    *published.lock().unwrap() = Some(jwk(OTHER_KEY, "key-2"));
    eventually(
        "the rotated key to be fetched",
        Duration::from_secs(30),
        || async { call(second()).await.0 == 200 },
    )
    .await
    .unwrap();
    let (status, body) = call(first()).await;
    assert_eq!(status, 401, "the retired key: {body}");

    // The issuer goes down: the keys held keep serving.
    *published.lock().unwrap() = None;
    let (status, body) = call(second()).await;
    assert_eq!(status, 200, "the held key while the issuer is down: {body}");
}

/// What the victim's Function answers: its secret, and what the gateway sent it.
const VAULT: &str = r#"
module.exports = {
  main: (event) => {
    const headers = event.extensions.request.headers;
    return { secret: "vault-data", path: event.extensions.request.url,
             tenant: headers["x-tenant"] || null, cookie: headers.cookie || null };
  },
};
"#;

/// The attack probe's APIRule findings, replayed as the attacker did them: someone who may
/// apply manifests in namespace `aaa-mallory` goes after the Function `vault` in `victim`,
/// which a JWT APIRule protects.
/// - An APIRule sending calls to another namespace's Service is refused by name, in either
///   place a Service is named, so no host of Mallory's reaches the vault.
/// - Mallory's older APIRule squats the host the victim's APIRule names: the victim's APIRule
///   is not honoured, `eddy apply` says so at once, and the vault's own gateway path is closed
///   (403), never open. Once the squatter is gone, the victim's APIRule takes the host and
///   binds the path: no token 401, a token for another audience 403 (`aud` is never split on
///   spaces), a right one 200.
/// - A rule cannot set the headers that frame a request or carry the caller's identity; the
///   headers and cookies it may set reach the Function.
/// - `/metrics` on an APIRule's host is the Function's; dot segments are refused on a host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apirule_in_one_namespace_cannot_open_a_function_of_another() {
    let (jwks_uri, _) = serve_jwks().await;
    let platform = Platform::start_with(support::Options {
        dispatcher: false,
        ..support::Options::default()
    })
    .await;
    let port = platform.gateway.rsplit(':').next().unwrap().to_owned();
    let hosts = platform.host_client(&["vault.localhost", "steal.localhost", "tenant.localhost"]);
    let indent = |text: &str| text.replace('\n', "\n        ");

    // Mallory's decoy, exposed first on the host the victim will ask for.
    let (ok, stdout, stderr) = platform
        .apply_text(&format!(
            r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {{name: decoy, namespace: aaa-mallory}}
spec:
  runtime: nodejs22
  source:
    inline:
      source: |
        {}
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {{name: squat, namespace: aaa-mallory}}
spec:
  hosts: [vault]
  service: {{name: decoy, port: 80}}
  rules: [{{path: /*, methods: [GET], noAuth: true}}]
"#,
            indent("module.exports = { main: () => 'decoy' }")
        ))
        .await;
    assert!(ok, "{stdout}\n{stderr}");
    eventually("squat to be Ready", Duration::from_secs(30), || async {
        platform.apirule_state("aaa-mallory", "squat").await.0 == "Ready"
    })
    .await
    .unwrap();

    // The victim's JWT APIRule, a second later: accepted, but not honoured, and said so.
    let victim = format!(
        r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {{name: vault, namespace: victim}}
spec:
  runtime: nodejs22
  source:
    inline:
      source: |
        {}
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {{name: vault, namespace: victim}}
spec:
  hosts: [vault]
  service: {{name: vault, port: 80}}
  rules:
    - path: /*
      methods: [GET]
      jwt:
        authentications: [{{issuer: "{ISSUER}", jwksUri: "{jwks_uri}"}}]
        authorizations: [{{audiences: [vault]}}]
"#,
        indent(VAULT)
    );
    let (ok, stdout, stderr) = platform.apply_text(&victim).await;
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stderr.contains(
            "Warning: apirule.gateway.kyma-project.io/vault: not honoured: host vault.localhost \
             is already exposed by APIRule aaa-mallory/squat"
        ),
        "{stderr}"
    );
    platform.wait_running_at("victim", "vault").await;
    eventually(
        "the victim's APIRule to be an Error",
        Duration::from_secs(30),
        || async { platform.apirule_state("victim", "vault").await.0 == "Error" },
    )
    .await
    .unwrap();
    let by_path = format!("{}/victim/vault/admin", platform.gateway);
    let good = jwt(ISSUER_KEY, "key-1", json!({"aud": "vault"}));
    for token in [None, Some(good.clone())] {
        let mut request = platform.http.get(&by_path);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let body = response.text().await.unwrap();
        assert_eq!(status, 403, "{body}");
        assert!(body.contains("function victim/vault is closed"), "{body}");
        assert!(!body.contains("vault-data"), "{body}");
    }

    // An APIRule naming another namespace's Service is refused, wherever it names it.
    for service in [
        "  service: {name: vault, namespace: victim, port: 80}\n  rules: [{path: /*, methods: [GET], noAuth: true}]",
        "  rules: [{path: /*, methods: [GET], noAuth: true, service: {name: vault, namespace: victim, port: 80}}]",
    ] {
        let (ok, stdout, stderr) = platform
            .apply_text(&format!(
                "apiVersion: gateway.kyma-project.io/v2\nkind: APIRule\nmetadata: {{name: steal, namespace: aaa-mallory}}\nspec:\n  hosts: [steal]\n{service}\n"
            ))
            .await;
        assert!(!ok, "{stdout}");
        assert!(
            stderr.contains("service.namespace: an APIRule in namespace aaa-mallory cannot send calls to namespace victim"),
            "{stderr}"
        );
    }
    let stolen = hosts
        .get(format!("http://steal.localhost:{port}/admin"))
        .send()
        .await
        .unwrap();
    assert_eq!(stolen.status(), 404);
    assert!(!stolen.text().await.unwrap().contains("vault-data"));

    // The squatter gone, the victim's APIRule holds its host and binds the Function's path.
    let (ok, _, stderr) = platform
        .eddy(&["delete", "apirules", "squat", "-n", "aaa-mallory"])
        .await;
    assert!(ok, "{stderr}");
    eventually(
        "the victim's APIRule to be Ready",
        Duration::from_secs(30),
        || async { platform.apirule_state("victim", "vault").await.0 == "Ready" },
    )
    .await
    .unwrap();
    let call = |url: String, token: Option<String>| {
        let request = hosts.get(url);
        let request = match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        async move {
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    let on_host = format!("http://vault.localhost:{port}/admin");
    for url in [by_path.clone(), on_host.clone()] {
        assert_eq!(call(url.clone(), None).await.0, 403, "{url}");
        let split_audience = jwt(ISSUER_KEY, "key-1", json!({"aud": "x vault"}));
        let (status, body) = call(url.clone(), Some(split_audience)).await;
        assert_eq!(status, 403, "{url}: {body}");
        let (status, body) = call(url.clone(), Some(good.clone())).await;
        assert_eq!(status, 200, "{url}: {body}");
        assert!(body.contains("vault-data"), "{body}");
    }
    // `/metrics` on an APIRule's host is the Function's own (its runtime's), behind its rule;
    // the gateway's, with every namespace's calls, stays on the gateway's own host.
    let metrics = format!("http://vault.localhost:{port}/metrics");
    assert_eq!(call(metrics.clone(), None).await.0, 403);
    let (status, body) = call(metrics, Some(good.clone())).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\nfunction_calls_total "), "{body}");
    assert!(!body.contains("eddy_function_calls_total"), "{body}");
    let own = platform
        .get_text(&format!("{}/metrics", platform.gateway))
        .await;
    assert!(own.contains("eddy_function_calls_total"), "{own}");

    // Headers a rule may not set, each refused by name.
    for header in [
        "content-length",
        "Host",
        "authorization",
        "transfer-encoding",
        "proxy-x",
    ] {
        let (ok, stdout, stderr) = platform
            .apply_text(&format!(
                r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {{name: tenant, namespace: victim}}
spec:
  hosts: [tenant]
  service: {{name: vault, port: 80}}
  rules:
    - path: /public/{{**}}
      methods: [GET]
      noAuth: true
      request: {{headers: {{"{header}": "3"}}}}
"#
            ))
            .await;
        assert!(!ok, "{header}: {stdout}");
        assert!(
            stderr.contains(&format!(
                "spec.rules[0].request.headers[{header}]: a rule cannot set this header"
            )),
            "{header}: {stderr}"
        );
    }
    // The ones it may set reach the Function, the cookies after the caller's.
    let (ok, stdout, stderr) = platform
        .apply_text(
            r#"apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {name: tenant, namespace: victim}
spec:
  hosts: [tenant]
  service: {name: vault, port: 80}
  rules:
    - path: /public/{**}
      methods: [GET]
      noAuth: true
      request: {headers: {x-tenant: acme}, cookies: {session: s1}}
"#,
        )
        .await;
    assert!(ok, "{stdout}\n{stderr}");
    eventually("tenant to be Ready", Duration::from_secs(30), || async {
        platform.apirule_state("victim", "tenant").await.0 == "Ready"
    })
    .await
    .unwrap();
    let response = hosts
        .get(format!("http://tenant.localhost:{port}/public/a"))
        .header("cookie", "a=b")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let seen: serde_json::Value = response.json().await.unwrap();
    assert_eq!(seen["tenant"], "acme", "{seen}");
    assert_eq!(seen["cookie"], "a=b; session=s1", "{seen}");
    // A dot segment cannot take `/public/{**}`'s noAuth to `/admin`: the path is resolved
    // before any rule is matched, and `/admin` is no route of this APIRule.
    for path in ["/public/../admin", "/public/%2e%2e/admin"] {
        let (status, text) = raw(
            &platform.gateway,
            format!("GET {path} HTTP/1.1\r\nHost: tenant.localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await;
        assert_eq!(status, 404, "{path}: {text}");
        assert!(!text.contains("vault-data"), "{path}: {text}");
    }
}

/// The probe's second finding: with `/admin/{**}` under `jwt` and `/{**}` under `noAuth`,
/// `/%61dmin/users` used to answer 200 (the rule was matched on the path as sent, the Function
/// got it decoded). Istio's gateway normalises the path before it matches a route (RFC 3986:
/// dot segments, merged slashes, escapes of unreserved characters decoded), and so does eddy's,
/// on an APIRule's host and on the Function's own path alike; the Function then gets the path
/// the rule was matched on. An encoded `/` and a `\`, raw or encoded, are refused (400): they
/// cannot be normalised for every reader alike. The JWT
/// rule's `authorizations` ask for every audience they list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn percent_encoding_does_not_walk_around_a_jwt_rule() {
    let (jwks_uri, _) = serve_jwks().await;
    let platform = Platform::start_with(support::Options {
        dispatcher: false,
        ..support::Options::default()
    })
    .await;
    let echo = ECHO.replace('\n', "\n        ");
    let (ok, stdout, stderr) = platform
        .apply_text(&format!(
            r#"apiVersion: serverless.kyma-project.io/v1alpha2
kind: Function
metadata: {{name: guarded}}
spec:
  runtime: nodejs22
  source:
    inline:
      source: |
        {echo}
---
apiVersion: gateway.kyma-project.io/v2
kind: APIRule
metadata: {{name: guarded}}
spec:
  hosts: [guarded]
  service: {{name: guarded, port: 80}}
  rules:
    - path: /admin/{{**}}
      methods: [GET]
      jwt:
        authentications: [{{issuer: "{ISSUER}", jwksUri: "{jwks_uri}"}}]
        authorizations: [{{audiences: [shop, admin]}}]
    - path: /{{**}}
      methods: [GET]
      noAuth: true
"#
        ))
        .await;
    assert!(ok, "{stdout}\n{stderr}");
    platform.wait_running_at("default", "guarded").await;
    eventually("guarded to be Ready", Duration::from_secs(30), || async {
        platform.apirule_state("default", "guarded").await.0 == "Ready"
    })
    .await
    .unwrap();
    let token = jwt(ISSUER_KEY, "key-1", json!({"aud": ["shop", "admin"]}));
    let ask = |host: &'static str, path: String, token: Option<&str>| {
        let gateway = platform.gateway.clone();
        let authorization =
            token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        async move {
            raw(
                &gateway,
                format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{authorization}Connection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await
        }
    };
    for (host, prefix) in [("guarded.localhost", ""), ("localhost", "/default/guarded")] {
        for admin in [
            "/admin/users",
            "/%61dmin/users",
            "/%61%64%6D%69%6E/users",
            "/public/../admin/users",
            "/public/%2E%2E/%61dmin/users",
            "//admin//users",
            "/./admin/users",
        ] {
            let path = format!("{prefix}{admin}");
            let (status, text) = ask(host, path.clone(), None).await;
            assert_eq!(status, 403, "{host} {path}: {text}");
            assert!(!text.contains(r#""function""#), "{host} {path}: {text}");
            let (status, text) = ask(host, path.clone(), Some(&token)).await;
            assert_eq!(status, 200, "{host} {path}: {text}");
            assert!(
                text.contains(r#""path":"/admin/users""#),
                "{host} {path}: {text}"
            );
        }
        // Kyma's api-gateway docs: "The token's aud claim must contain all listed audiences".
        let one_audience = jwt(ISSUER_KEY, "key-1", json!({"aud": "admin"}));
        let (status, text) = ask(host, format!("{prefix}/admin/users"), Some(&one_audience)).await;
        assert_eq!(status, 403, "{host}: one of two audiences: {text}");
        let (status, text) = ask(host, format!("{prefix}/%70ublic/x"), None).await;
        assert_eq!(status, 200, "{host}: {text}");
        assert!(text.contains(r#""path":"/public/x""#), "{host}: {text}");
        let (status, text) = ask(host, format!("{prefix}/admin%2Fusers"), None).await;
        assert_eq!(status, 400, "{host}: {text}");
        assert!(text.contains("encoded '/'"), "{host}: {text}");
        // The probe's third finding: `/x\..\admin/users` was matched by `/{**}` (noAuth) as one
        // segment and reached the Function, whose `new URL(req.originalUrl)` read `\` as `/`
        // (200 where `/admin/users` got 403). A raw `\` is refused as `%5C` is.
        for admin in [
            "/x\\..\\admin/users",
            "/public\\..\\admin/users",
            "/admin\\users",
        ] {
            let path = format!("{prefix}{admin}");
            let (status, text) = ask(host, path.clone(), None).await;
            assert_eq!(status, 400, "{host} {path}: {text}");
            assert!(
                text.contains("which some readers take for '/'"),
                "{host} {path}: {text}"
            );
            assert!(!text.contains(r#""function""#), "{host} {path}: {text}");
        }
    }
}

/// A Node.js handler whose module never finishes loading (it blocks its only thread, without
/// burning it, for an hour): its instance never becomes ready.
const NEVER_READY: &str = r#"
Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 3600e3);
module.exports = { main: () => "never" };
"#;

/// The probe's fourth finding: held calls were bounded in time but not in memory (two hundred
/// 2 MB calls to a Function at zero that never became ready held about 500 MB in eddy). Calls
/// waiting for an instance now hold at most `--max-held-bytes` of bodies over every Function,
/// and one Function at most its share (`--held-share-per-function`): past it a call is
/// answered 503 with `Retry-After` at once, naming the bound, and another Function's call
/// that has to wait for its instance still finds room and is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_waiting_for_an_instance_hold_a_bounded_number_of_bytes_per_function() {
    const BODY: usize = 2 * 1024 * 1024;
    let platform = Platform::start_with(support::Options {
        dispatcher: false,
        scale_to_zero_after: Duration::from_secs(2),
        scale_down_window: Duration::from_millis(500),
        activation_timeout: Duration::from_secs(60),
        hold: eddy_platform::flags::HoldArgs {
            max_held_calls: 1000,
            max_held_bytes: bytesize::ByteSize::b(4 * BODY as u64),
            held_share_percent: 50,
        },
        ..support::Options::default()
    })
    .await;
    let scale = json!({"minReplicas": 0, "maxReplicas": 1});
    let spec = |source: &str| json!({"runtime": "nodejs22", "source": {"inline": {"source": source}}, "scaleConfig": scale});
    platform.deploy("sleepy", spec(ECHO)).await;
    let (status, body) = platform.put_function("stuck", spec(NEVER_READY)).await;
    assert!(status == 200 || status == 201, "{status}: {body}");
    eventually(
        "sleepy at zero, stuck built",
        Duration::from_secs(60),
        || async {
            let stuck = platform.function_at("default", "stuck").await;
            platform.pids("sleepy").is_empty()
                && support::condition_of(&stuck, "BuildReady").0 == "True"
        },
    )
    .await
    .unwrap();

    // Twenty 2 MiB calls to the Function that never starts: two fit its half of the 8 MiB,
    // and the other eighteen are answered at once (a body's declared length is charged before
    // any of it is kept, so the first two to come take the room whole).
    let body = bytes::Bytes::from(vec![b'x'; BODY]);
    let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..20 {
        let call = platform.invoke("stuck", "/").body(body.clone());
        let answers = answers.clone();
        tokio::spawn(async move {
            let Ok(response) = call.send().await else {
                return;
            };
            let retry_after = response.headers().contains_key("retry-after");
            let status = response.status().as_u16();
            let text = response.text().await.unwrap_or_default();
            let _ = answers.send((status, retry_after, text));
        });
    }
    let refusal = |(status, retry_after, text): (u16, bool, String)| {
        assert_eq!(status, 503, "{text}");
        assert!(retry_after, "{text}");
        assert!(text.contains("--held-share-per-function"), "{text}");
    };
    for _ in 0..18 {
        refusal(
            tokio::time::timeout(Duration::from_secs(20), answered.recv())
                .await
                .expect("eighteen calls answered at once")
                .unwrap(),
        );
    }
    let mut held = 2;
    while let Ok(Some(answer)) = tokio::time::timeout(Duration::from_secs(1), answered.recv()).await
    {
        refusal(answer);
        held -= 1;
    }

    // The other Function's wake-up still has room: its call waits for its instance and is
    // answered by it.
    // (512 KiB: Kyma's runtime takes bodies up to 1 MB.)
    let woken = platform
        .invoke("sleepy", "/")
        .json(&json!({"padding": "x".repeat(512 * 1024)}))
        .send()
        .await
        .unwrap();
    assert_eq!(woken.status(), 200, "{:?}", woken.text().await);
    assert_eq!(held, 2, "two calls of 2 MiB fit the Function's 4 MiB");
    assert!(
        answered.try_recv().is_err(),
        "the {held} held calls to the stuck Function are still held"
    );
}
