//! JWT access (`spec.access.mode: jwt`), checked by the gateway as Kyma's APIRule does: a bearer
//! JWT signed with one of the issuer's keys (its JWKS), with the issuer's `iss`, not expired and
//! already valid (`exp`, `nbf`; 30 s leeway), naming one of the audiences in `aud` when they are
//! given, without critical header extensions (`crit`), and carrying every required claim. No
//! token, a bad signature, the wrong issuer or audience, an expired token: 401. A
//! valid token without a required claim: 403. The issuer's keys cannot be fetched: 503.
//!
//! The JWKS is fetched on first use, kept for 5 minutes, and fetched again at once (at most every
//! 10 s) when a token names a key it does not have, so the issuer's key rotation needs no restart.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use eddy_model::resources::JwtAccess;
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use jsonwebtoken::{Algorithm, DecodingKey, Validation, errors::ErrorKind, jwk::JwkSet};
use serde_json::Value;

/// How long fetched keys are used before they are fetched again.
const KEYS_FRESH_FOR: Duration = Duration::from_secs(300);
/// Least time between two fetches caused by unknown keys.
const REFETCH_AT_MOST_EVERY: Duration = Duration::from_secs(10);
/// Longest a JWKS fetch may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest JWKS document read.
const MAX_JWKS_BYTES: usize = 256 * 1024;
/// Clock skew allowed on `exp` and `nbf`.
const LEEWAY_SECONDS: u64 = 30;
/// Signature algorithms accepted: asymmetric only (a public JWKS cannot hold an HMAC secret,
/// and accepting HS* would let a public key be used as one).
const ALGORITHMS: [Algorithm; 8] = [
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
];

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>;

/// The one client every verifier fetches its JWKS with: the platform's TLS client (system
/// roots), built once (a TLS configuration is costly), its connections to an issuer shared.
fn jwks_client() -> std::io::Result<HttpsClient> {
    static CLIENT: std::sync::OnceLock<HttpsClient> = std::sync::OnceLock::new();
    if let Some(client) = CLIENT.get() {
        return Ok(client.clone());
    }
    let client =
        eddy_platform::net::pooled_tls_client(Duration::from_secs(90), Some(FETCH_TIMEOUT))
            .map_err(|error| std::io::Error::other(error.to_string()))?;
    Ok(CLIENT.get_or_init(|| client).clone())
}

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// 401, 403 or 503.
    pub status: StatusCode,
    /// Said to the caller (never the token or its claims).
    pub message: String,
}

impl Refusal {
    /// A 401 saying `message`.
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
        }
    }
}

/// The fetched keys, when they were fetched, and when a fetch was last tried.
struct Keys {
    set: Arc<JwkSet>,
    fetched: Instant,
    tried: Instant,
}

/// Whether to fetch the JWKS now, holding `held`, for a token whose key id the held keys lack
/// (`lacks_kid`). Fresh keys serve for [`KEYS_FRESH_FOR`]; stale keys, or keys without the
/// token's id, are fetched again, but at most every [`REFETCH_AT_MOST_EVERY`] counted from the
/// last try: while the issuer is down, the held keys serve calls without each one waiting for
/// a fetch that will fail.
fn fetch_due(held: &Keys, lacks_kid: bool, now: Instant) -> bool {
    let since_try = now.saturating_duration_since(held.tried);
    let stale = now.saturating_duration_since(held.fetched) >= KEYS_FRESH_FOR;
    (stale || lacks_kid) && since_try >= REFETCH_AT_MOST_EVERY
}

/// Checks bearer JWTs for one Function's `access.jwt`.
pub struct JwtVerifier {
    spec: JwtAccess,
    /// One validation per key family: a key of one family checks only its algorithms.
    rsa: Validation,
    ec: Validation,
    client: HttpsClient,
    keys: tokio::sync::Mutex<Option<Keys>>,
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtVerifier")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl JwtVerifier {
    /// A verifier for `spec` (nothing is fetched yet).
    pub fn new(spec: JwtAccess) -> std::io::Result<Self> {
        let validation = |elliptic: bool| {
            let mut validation = Validation::new(Algorithm::RS256);
            validation.algorithms = ALGORITHMS
                .into_iter()
                .filter(|alg| is_elliptic(*alg) == elliptic)
                .collect();
            validation.leeway = LEEWAY_SECONDS;
            validation.validate_nbf = true;
            validation.set_issuer(&[spec.issuer.as_str()]);
            if spec.audiences.is_empty() {
                validation.set_required_spec_claims(&["exp", "iss"]);
                validation.validate_aud = false;
            } else {
                // A token without `aud` is for no audience in particular: refused.
                validation.set_required_spec_claims(&["exp", "iss", "aud"]);
                validation.set_audience(&spec.audiences);
            }
            validation
        };
        let (rsa, ec) = (validation(false), validation(true));
        let client = jwks_client()?;
        Ok(Self {
            spec,
            rsa,
            ec,
            client,
            keys: tokio::sync::Mutex::new(None),
        })
    }

    /// The access this verifier checks.
    pub fn spec(&self) -> &JwtAccess {
        &self.spec
    }

    /// Checks the request's bearer JWT; its claims when it passes.
    pub async fn check(&self, headers: &HeaderMap) -> Result<Value, Refusal> {
        let Some(token) = eddy_platform::auth::bearer_token(headers) else {
            return Err(Refusal::unauthenticated("a bearer JWT is required"));
        };
        self.check_token(token).await
    }

    /// Checks one JWT, however it came; its claims when it passes.
    pub async fn check_token(&self, token: &str) -> Result<Value, Refusal> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| Refusal::unauthenticated("the bearer token is not a JWT"))?;
        if !ALGORITHMS.contains(&header.alg) {
            return Err(Refusal::unauthenticated(format!(
                "JWT algorithm {:?} is not accepted",
                header.alg
            )));
        }
        // RFC 7515 4.1.11: extensions listed in `crit` must be understood; eddy knows none.
        if header.crit.is_some() {
            return Err(Refusal::unauthenticated(
                "the JWT names critical header extensions (crit), which are not supported",
            ));
        }
        let jwks = self.keys_for(header.kid.as_deref()).await?;
        let jwk = match header.kid.as_deref() {
            Some(kid) => jwks.find(kid),
            None if jwks.keys.len() == 1 => jwks.keys.first(),
            None => None,
        }
        .ok_or_else(|| {
            Refusal::unauthenticated("the JWT is not signed with a key of the issuer")
        })?;
        let key = DecodingKey::from_jwk(jwk)
            .map_err(|_| Refusal::unauthenticated("the issuer's key cannot be used"))?;
        let validation = if is_elliptic(header.alg) {
            &self.ec
        } else {
            &self.rsa
        };
        let claims = jsonwebtoken::decode::<Value>(token, &key, validation)
            .map_err(|error| Refusal::unauthenticated(describe(error.kind())))?
            .claims;
        match missing_claim(&claims, &self.spec) {
            Some(name) => Err(Refusal {
                status: StatusCode::FORBIDDEN,
                message: format!("the JWT lacks the required claim {name}"),
            }),
            None => Ok(claims),
        }
    }

    /// The JWKS, fetched when there is none, when it is stale, or when it lacks `kid` (then at
    /// most every [`REFETCH_AT_MOST_EVERY`]).
    async fn keys_for(&self, kid: Option<&str>) -> Result<Arc<JwkSet>, Refusal> {
        let mut keys = self.keys.lock().await;
        let now = Instant::now();
        let wanted = match keys.as_ref() {
            None => true,
            Some(held) => {
                let lacks_kid = kid.is_some_and(|kid| held.set.find(kid).is_none());
                fetch_due(held, lacks_kid, now)
            }
        };
        if wanted {
            match self.fetch().await {
                Ok(set) => {
                    *keys = Some(Keys {
                        set: Arc::new(set),
                        fetched: now,
                        tried: now,
                    });
                }
                Err(problem) => {
                    tracing::warn!(jwks = %self.spec.jwks_uri, %problem, "cannot fetch the issuer's keys");
                    // Keys fetched earlier keep serving while the issuer is unreachable.
                    match keys.as_mut() {
                        Some(held) => held.tried = now,
                        None => {
                            return Err(Refusal {
                                status: StatusCode::SERVICE_UNAVAILABLE,
                                message: "the issuer's keys cannot be fetched".to_owned(),
                            });
                        }
                    }
                }
            }
        }
        keys.as_ref().map(|held| held.set.clone()).ok_or(Refusal {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the issuer's keys cannot be fetched".to_owned(),
        })
    }

    async fn fetch(&self) -> Result<JwkSet, FetchError> {
        let uri: http::Uri = self.spec.jwks_uri.parse().map_err(FetchError::Uri)?;
        let request = http::Request::get(uri)
            .header(http::header::ACCEPT, "application/json")
            .body(Empty::new())
            .map_err(FetchError::Request)?;
        let fetched = tokio::time::timeout(FETCH_TIMEOUT, async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(FetchError::Client)?;
            if !response.status().is_success() {
                return Err(FetchError::Status(response.status()));
            }
            let body = http_body_util::Limited::new(response.into_body(), MAX_JWKS_BYTES)
                .collect()
                .await
                .map_err(FetchError::Body)?
                .to_bytes();
            Ok(body)
        })
        .await
        .map_err(|_| FetchError::Timeout(FETCH_TIMEOUT))??;
        serde_json::from_slice(&fetched).map_err(FetchError::NotJwks)
    }
}

/// Why an issuer's keys could not be fetched (logged; the call is refused with 503 unless keys
/// fetched earlier still serve).
#[derive(Debug, thiserror::Error)]
enum FetchError {
    #[error("invalid JWKS URI: {0}")]
    Uri(http::uri::InvalidUri),
    #[error("{0}")]
    Request(http::Error),
    #[error("{0}")]
    Client(hyper_util::client::legacy::Error),
    #[error("answered {0}")]
    Status(StatusCode),
    #[error("reading the JWKS: {0}")]
    Body(Box<dyn std::error::Error + Send + Sync>),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("not a JWKS: {0}")]
    NotJwks(serde_json::Error),
}

/// Whether `alg` is an elliptic-curve signature (the rest of [`ALGORITHMS`] are RSA).
fn is_elliptic(alg: Algorithm) -> bool {
    matches!(alg, Algorithm::ES256 | Algorithm::ES384)
}

/// What a refused token is told, from why `jsonwebtoken` refused it. Pure.
fn describe(kind: &ErrorKind) -> &'static str {
    match kind {
        ErrorKind::ExpiredSignature => "the JWT has expired",
        ErrorKind::ImmatureSignature => "the JWT is not valid yet",
        ErrorKind::InvalidIssuer => "the JWT is from another issuer",
        ErrorKind::InvalidAudience => "the JWT is for another audience",
        ErrorKind::InvalidSignature => "the JWT's signature does not verify",
        ErrorKind::MissingRequiredClaim(claim) => match claim.as_str() {
            "aud" => "the JWT lacks aud",
            "iss" => "the JWT lacks iss",
            _ => "the JWT lacks exp",
        },
        ErrorKind::InvalidAlgorithm => "the JWT's algorithm does not match the issuer's key",
        _ => "the JWT is not valid",
    }
}

/// The first required claim `claims` lacks: a string claim must equal the value, an array
/// claim contain it, and a space-separated claim (OAuth's `scope`) have it as one word. Pure.
pub fn missing_claim<'a>(claims: &Value, spec: &'a JwtAccess) -> Option<&'a str> {
    spec.required_claims
        .iter()
        .find(|(name, wanted)| {
            let has = match claims.get(name.as_str()) {
                Some(Value::String(value)) => {
                    value == *wanted || value.split(' ').any(|word| word == wanted.as_str())
                }
                Some(Value::Array(values)) => {
                    values.iter().any(|v| v.as_str() == Some(wanted.as_str()))
                }
                Some(Value::Bool(value)) => value.to_string() == **wanted,
                Some(Value::Number(value)) => value.to_string() == **wanted,
                _ => false,
            };
            !has
        })
        .map(|(name, _)| name.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(claims: &[(&str, &str)]) -> JwtAccess {
        JwtAccess {
            issuer: "https://id.example.com/".to_owned(),
            jwks_uri: "https://id.example.com/jwks".to_owned(),
            audiences: Vec::new(),
            required_claims: claims
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn required_claims_match_strings_arrays_and_scope_words() {
        let spec = spec(&[
            ("scope", "orders:write"),
            ("groups", "admins"),
            ("tier", "gold"),
        ]);
        let all = json!({"scope": "orders:read orders:write", "groups": ["dev", "admins"], "tier": "gold"});
        assert_eq!(missing_claim(&all, &spec), None);
        let no_scope = json!({"scope": "orders:read", "groups": ["admins"], "tier": "gold"});
        assert_eq!(missing_claim(&no_scope, &spec), Some("scope"));
        let prefix_only = json!({"scope": "orders:writer", "groups": ["admins"], "tier": "gold"});
        assert_eq!(
            missing_claim(&prefix_only, &spec),
            Some("scope"),
            "whole words only"
        );
        let wrong_group = json!({"scope": "orders:write", "groups": ["dev"], "tier": "gold"});
        assert_eq!(missing_claim(&wrong_group, &spec), Some("groups"));
        let absent = json!({"scope": "orders:write", "groups": ["admins"]});
        assert_eq!(missing_claim(&absent, &spec), Some("tier"));
        let number = JwtAccess {
            required_claims: [("level".to_owned(), "3".to_owned())].into(),
            ..spec.clone()
        };
        assert_eq!(missing_claim(&json!({"level": 3}), &number), None);
        assert_eq!(
            missing_claim(&json!({"level": {"x": 3}}), &number),
            Some("level")
        );
    }

    /// Keys serve for five minutes, then are fetched again; a failed refresh (or a search for
    /// an unknown key id) is tried again after ten seconds, not at every call.
    #[test]
    fn keys_are_fetched_again_after_five_minutes_and_failures_are_not_retried_at_every_call() {
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let mut held = Keys {
            set: Arc::new(JwkSet { keys: Vec::new() }),
            fetched: start,
            tried: start,
        };
        assert!(!fetch_due(&held, false, at(1)), "fresh keys serve");
        assert!(!fetch_due(&held, false, at(299)), "for five minutes");
        assert!(
            fetch_due(&held, false, at(300)),
            "then they are fetched again"
        );
        // The issuer is down at 300 s: the stale keys serve, and the next try is 10 s later.
        held.tried = at(300);
        assert!(!fetch_due(&held, false, at(301)));
        assert!(!fetch_due(&held, false, at(309)));
        assert!(fetch_due(&held, false, at(310)));
        // An unknown key id: fetched at once (the last try was long ago), then at most every
        // 10 s.
        held.tried = at(310);
        held.fetched = at(310);
        assert!(!fetch_due(&held, true, at(315)));
        assert!(fetch_due(&held, true, at(320)));
        assert!(
            !fetch_due(&held, false, at(320)),
            "known ids wait for the five minutes"
        );
    }

    #[test]
    fn refusals_say_why_without_the_token() {
        assert_eq!(
            describe(&ErrorKind::ExpiredSignature),
            "the JWT has expired"
        );
        assert_eq!(
            describe(&ErrorKind::InvalidIssuer),
            "the JWT is from another issuer"
        );
        assert_eq!(describe(&ErrorKind::InvalidToken), "the JWT is not valid");
    }
}
