//! External authorizers (an APIRule rule's `extAuth`), called as Envoy's HTTP ext_authz filter
//! calls them for Istio: the request's method and path (after the provider's `pathPrefix`),
//! its `Host`, `Authorization` and the headers the provider lists, no body. A 2xx answer lets
//! the call through, with the answer's headers the provider lists set on the request to the
//! Function; any other answer goes back to the caller as the authorizer gave it. An authorizer
//! that cannot be asked (down, too slow) answers `statusOnError` (403), or lets the call through
//! when the provider says `failOpen`.

use std::time::Duration;

use axum::response::{IntoResponse as _, Response};
use bytes::Bytes;
use eddy_model::ext_authz::{
    ALWAYS_SENT, HttpAuthorizer, any_matches, is_copyable, passes_on_deny,
};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper_util::client::legacy::{Client, connect::HttpConnector};

/// The most of a denying answer's body passed on to the caller.
const MAX_DENIAL_BODY: usize = 64 * 1024;

type PlainClient = Client<HttpConnector, Empty<Bytes>>;

/// The one client every authorizer is called with: its connections pooled per authorizer.
fn client() -> PlainClient {
    static CLIENT: std::sync::OnceLock<PlainClient> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            eddy_platform::net::pooled_client(Duration::from_secs(90), Some(Duration::from_secs(5)))
        })
        .clone()
}

/// Headers a rule's authorizers gave an allowed call: for the Function's request, and for the
/// caller's answer.
#[derive(Debug, Default)]
pub struct Granted {
    /// Set on the request to the Function.
    pub upstream: Vec<(HeaderName, HeaderValue)>,
    /// Added to the answer to the caller.
    pub downstream: Vec<(HeaderName, HeaderValue)>,
}

/// One HTTP authorizer, ready to be called.
#[derive(Debug)]
pub struct Authorizer {
    spec: HttpAuthorizer,
    /// `includeAdditionalHeadersInCheck`, parsed once (the provider's checks refused bad ones).
    additional: Vec<(HeaderName, HeaderValue)>,
    client: PlainClient,
}

impl Authorizer {
    /// An authorizer as its provider describes it.
    pub fn new(spec: HttpAuthorizer) -> Self {
        let additional =
            crate::header_pairs(spec.additional.iter().map(|(name, value)| (name, value)));
        Self {
            spec,
            additional,
            client: client(),
        }
    }

    /// Its provider's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Asks it about a `method` call to `path_and_query` (the path the rule matched, with its
    /// query) carrying `headers`; adds what an allowing answer grants to `granted`, or gives the
    /// answer the caller gets.
    pub async fn check(
        &self,
        method: &Method,
        path_and_query: &str,
        headers: &HeaderMap,
        granted: &mut Granted,
    ) -> Result<(), Response> {
        let answer = match self.ask(method, path_and_query, headers).await {
            Ok(answer) => answer,
            Err(why) => {
                tracing::warn!(
                    authorizer = %self.spec.name, %why,
                    fail_open = self.spec.fail_open,
                    "the external authorizer could not be asked"
                );
                if self.spec.fail_open {
                    return Ok(());
                }
                let status = StatusCode::from_u16(self.spec.status_on_error)
                    .unwrap_or(StatusCode::FORBIDDEN);
                return Err(status.into_response());
            }
        };
        let (parts, body) = answer;
        if parts.status.is_success() {
            for (name, value) in &parts.headers {
                let name_text = name.as_str();
                if !is_copyable(name_text) {
                    continue;
                }
                if any_matches(&self.spec.to_upstream_on_allow, name_text) {
                    granted.upstream.push((name.clone(), value.clone()));
                }
                if any_matches(&self.spec.to_downstream_on_allow, name_text) {
                    granted.downstream.push((name.clone(), value.clone()));
                }
            }
            return Ok(());
        }
        tracing::debug!(
            authorizer = %self.spec.name, status = %parts.status,
            "the external authorizer denied a call"
        );
        let mut denial = Response::new(axum::body::Body::from(body));
        *denial.status_mut() = parts.status;
        for (name, value) in &parts.headers {
            if passes_on_deny(&self.spec, name.as_str()) {
                denial.headers_mut().append(name.clone(), value.clone());
            }
        }
        Err(denial)
    }

    /// The check request and its answer (the body cut at [`MAX_DENIAL_BODY`]), or why there is
    /// none.
    async fn ask(
        &self,
        method: &Method,
        path_and_query: &str,
        headers: &HeaderMap,
    ) -> Result<(http::response::Parts, Bytes), String> {
        let uri = format!("{}{path_and_query}", self.spec.base_url);
        let mut request = http::Request::new(Empty::<Bytes>::new());
        *request.method_mut() = method.clone();
        *request.uri_mut() = uri
            .parse()
            .map_err(|error| format!("the check's URL {uri:?}: {error}"))?;
        let sent = request.headers_mut();
        for (name, value) in headers {
            let name_text = name.as_str();
            if ALWAYS_SENT.contains(&name_text) || any_matches(&self.spec.include, name_text) {
                sent.append(name.clone(), value.clone());
            }
        }
        for (name, value) in &self.additional {
            sent.insert(name.clone(), value.clone());
        }
        sent.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        let call = async {
            let answer = self
                .client
                .request(request)
                .await
                .map_err(|error| format!("{uri}: {}", with_causes(&error)))?;
            let (parts, body) = answer.into_parts();
            let body = Limited::new(body, MAX_DENIAL_BODY)
                .collect()
                .await
                .map_err(|error| format!("{uri}: its answer's body: {error}"))?
                .to_bytes();
            Ok::<_, String>((parts, body))
        };
        tokio::time::timeout(self.spec.timeout, call)
            .await
            .map_err(|_| format!("{uri}: no answer within {:?}", self.spec.timeout))?
    }
}

/// An error with its causes, `: `-separated (hyper's own text says only "client error").
fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(each) = cause {
        text.push_str(": ");
        text.push_str(&each.to_string());
        cause = each.source();
    }
    text
}
