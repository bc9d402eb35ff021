//! An ES256 issuer for JWT tests: its keys, tokens signed with them, and its JWKS served.
#![allow(dead_code, clippy::unwrap_used)]

use serde_json::json;

pub const ISSUER_KEY: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgCPv6U6k+Fuiy4NxK
kqmnx4mEdGoK8BWL7Y+AAP9XfdGhRANCAATxpRQTnZYmxQ5t4Huz5rCmIA9Dgikn
hv1V+VNI07Q04fonM1ynMK7W9OSRmdX1WYaRRhJ5S3SCKhu4t6P/ifq1
-----END PRIVATE KEY-----
";
pub const OTHER_KEY: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg2hk4Jg53mr1ZrR70
lrjNSC4F6obgyGnnyS4g3rNil5yhRANCAARqiwruw2h5+CMQuBtc5gFjGHKzRbAt
bBaAMulcKfmFwe8FkdKLfxzNKOH3QEikJYDRwoAl5rx3uim61wJSwG23
-----END PRIVATE KEY-----
";
pub const ISSUER: &str = "https://id.example.com/";

pub fn now_seconds() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
    )
    .unwrap()
}

/// A JWT signed with `pem` (ES256) under `kid`, with `claims` over a valid base.
pub fn jwt(pem: &str, kid: &str, claims: serde_json::Value) -> String {
    jwt_with_crit(pem, kid, claims, None)
}

/// [`jwt`] whose header lists `crit` extensions.
pub fn jwt_with_crit(
    pem: &str,
    kid: &str,
    claims: serde_json::Value,
    crit: Option<Vec<String>>,
) -> String {
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    let mut all = json!({
        "iss": ISSUER, "sub": "alice", "aud": "orders",
        "exp": now_seconds() + 300, "iat": now_seconds(), "scope": "orders:read orders:write",
    });
    for (name, value) in claims.as_object().unwrap() {
        if value.is_null() {
            all.as_object_mut().unwrap().remove(name);
        } else {
            all[name] = value.clone();
        }
    }
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some(kid.to_owned());
    header.crit = crit;
    let key = EncodingKey::from_ec_pem(pem.as_bytes()).unwrap();
    jsonwebtoken::encode(&header, &all, &key).unwrap()
}

type Fetches = std::sync::Arc<std::sync::atomic::AtomicUsize>;

/// The issuer's JWKS (only `ISSUER_KEY`, as `key-1`) at `/jwks`, counting its fetches.
fn jwks_app() -> (axum::Router, Fetches) {
    use jsonwebtoken::{Algorithm, EncodingKey, jwk::Jwk};
    let key = EncodingKey::from_ec_pem(ISSUER_KEY.as_bytes()).unwrap();
    let mut jwk = Jwk::from_encoding_key(&key, Algorithm::ES256).unwrap();
    jwk.common.key_id = Some("key-1".to_owned());
    let document = json!({"keys": [jwk]});
    let fetches = Fetches::default();
    let counted = fetches.clone();
    let app = axum::Router::new().route(
        "/jwks",
        axum::routing::get(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let document = document.clone();
            async move { axum::Json(document) }
        }),
    );
    (app, fetches)
}

/// Serves the issuer's JWKS over HTTP on loopback and counts its fetches.
pub async fn serve_jwks() -> (String, Fetches) {
    let (app, fetches) = jwks_app();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("{url}/jwks"), fetches)
}

/// Serves the issuer's JWKS over HTTPS on `ip` with `pki`'s server certificate (made for that
/// address) and counts its fetches.
pub async fn serve_jwks_tls(pki: &eddy_testing::pki::Pki, ip: &str) -> (String, Fetches) {
    let (app, fetches) = jwks_app();
    let addr = eddy_testing::pki::serve_tls(pki, ip, app).await;
    (format!("https://{addr}/jwks"), fetches)
}
