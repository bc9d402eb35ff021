//! External authorizers (an APIRule rule's `extAuth`), called as Envoy's HTTP ext_authz filter
//! calls them for Istio: the request's method and path (after the provider's `pathPrefix`),
//! its `Host`, `Authorization` and the headers the provider lists, no body. A 2xx answer lets
//! the call through, with the answer's headers the provider lists set on the request to the
//! Function; any other answer goes back to the caller as the authorizer gave it. An authorizer
//! that cannot be asked (down, too slow) answers `statusOnError` (403), or lets the call through
//! when the provider says `failOpen`. An answer that started but cannot be read (too many or
//! too large headers, a malformed line) is a denial, answered `statusOnError` whatever
//! `failOpen` says: the authorizer was asked, and what it said may well have been no.

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::response::{IntoResponse as _, Response};
use bytes::Bytes;
use eddy_model::ext_authz::{
    ALWAYS_SENT, HttpAuthorizer, any_matches, is_copyable, passes_on_deny,
};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use parking_lot::Mutex;
use tokio::sync::Semaphore;

/// The most of a denying answer's body passed on to the caller (the rest is cut).
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

/// The checks each authorizer may have in flight, shared by every rule that names it (as
/// Envoy's circuit breaker is by every route to one cluster).
#[derive(Debug)]
pub struct CheckSlots {
    limit: usize,
    by_provider: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl CheckSlots {
    /// `limit` checks in flight per authorizer.
    pub fn new(limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            by_provider: Mutex::default(),
        }
    }

    /// The slots of the authorizer named `provider`.
    fn of(&self, provider: &str) -> Arc<Semaphore> {
        self.by_provider
            .lock()
            .entry(provider.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(self.limit)))
            .clone()
    }
}

/// One HTTP authorizer, ready to be called.
#[derive(Debug)]
pub struct Authorizer {
    spec: HttpAuthorizer,
    /// `includeAdditionalHeadersInCheck`, parsed once (the provider's checks refused bad ones).
    additional: Vec<(HeaderName, HeaderValue)>,
    client: PlainClient,
    /// Its checks in flight, shared with every rule naming it.
    slots: Arc<Semaphore>,
}

/// What a caller gets when the rule's timeout runs out before the call is answered (Envoy's
/// words for a route timeout).
pub fn timed_out() -> Response {
    (StatusCode::GATEWAY_TIMEOUT, "upstream request timeout").into_response()
}

impl Authorizer {
    /// An authorizer as its provider describes it, its checks in flight counted in `slots`.
    pub fn new(spec: HttpAuthorizer, slots: &CheckSlots) -> Self {
        let additional =
            crate::header_pairs(spec.additional.iter().map(|(name, value)| (name, value)));
        let slots = slots.of(&spec.name);
        Self {
            spec,
            additional,
            client: client(),
            slots,
        }
    }

    /// Its provider's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Asks it about a `method` call to `path_and_query` (the path the rule matched, with its
    /// query) carrying `headers`, answering by `deadline` at the latest (the rule's timeout);
    /// adds what an allowing answer grants to `granted`, or gives the answer the caller gets.
    /// The decision is taken from the answer's status and headers: a denial's body is passed
    /// on cut at 64 KiB, however large or slow the rest of it.
    pub async fn check(
        &self,
        method: &Method,
        path_and_query: &str,
        headers: &HeaderMap,
        deadline: tokio::time::Instant,
        granted: &mut Granted,
    ) -> Result<(), Response> {
        let own_deadline = tokio::time::Instant::now() + self.spec.timeout;
        // The authorizer's answer, its denial's body included, comes within both times.
        let answer_by = deadline.min(own_deadline);
        let asked = match self.slots.try_acquire() {
            Ok(_in_flight) => self.ask(method, path_and_query, headers, answer_by).await,
            Err(_) => Err(Unasked::Busy),
        };
        let answer = match asked {
            Ok(answer) => answer,
            Err(why @ Unasked::Unreadable { .. }) => {
                tracing::warn!(
                    authorizer = %self.spec.name, %why,
                    "the external authorizer's answer could not be read: the call is denied"
                );
                return Err(self.status_on_error().into_response());
            }
            // The call's own time ran out (the rule's timeout), not the authorizer's.
            Err(_) if deadline <= own_deadline && tokio::time::Instant::now() >= deadline => {
                tracing::warn!(
                    authorizer = %self.spec.name,
                    "the rule's timeout ran out while the external authorizer was asked"
                );
                return Err(timed_out());
            }
            Err(why) => {
                tracing::warn!(
                    authorizer = %self.spec.name, %why,
                    fail_open = self.spec.fail_open,
                    "the external authorizer could not be asked"
                );
                if self.spec.fail_open {
                    return Ok(());
                }
                return Err(self.status_on_error().into_response());
            }
        };
        let (parts, body) = answer.into_parts();
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
        let body = read_prefix(body, MAX_DENIAL_BODY, answer_by).await;
        let mut denial = Response::new(axum::body::Body::from(body));
        *denial.status_mut() = parts.status;
        for (name, value) in &parts.headers {
            if passes_on_deny(&self.spec, name.as_str()) {
                denial.headers_mut().append(name.clone(), value.clone());
            }
        }
        Err(denial)
    }

    /// What a call gets when the authorizer could not be asked, or its answer not read.
    fn status_on_error(&self) -> StatusCode {
        StatusCode::from_u16(self.spec.status_on_error).unwrap_or(StatusCode::FORBIDDEN)
    }

    /// The check request's answer, its status and headers read by `deadline`, or why there
    /// is none.
    async fn ask(
        &self,
        method: &Method,
        path_and_query: &str,
        headers: &HeaderMap,
        deadline: tokio::time::Instant,
    ) -> Result<http::Response<hyper::body::Incoming>, Unasked> {
        let uri = format!("{}{path_and_query}", self.spec.base_url);
        let mut request = http::Request::new(Empty::<Bytes>::new());
        *request.method_mut() = method.clone();
        *request.uri_mut() = uri.parse().map_err(|source| Unasked::Url {
            uri: uri.clone(),
            source,
        })?;
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
        match tokio::time::timeout_at(deadline, self.client.request(request)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(source)) if answer_started(&source) => Err(Unasked::Unreadable { uri, source }),
            Ok(Err(source)) => Err(Unasked::Failed { uri, source }),
            Err(_) => Err(Unasked::NoAnswer { uri }),
        }
    }
}

/// Why an external authorizer could not be asked (logged; the call is then refused with the
/// authorizer's status on error, or let through where it fails open).
#[derive(Debug, thiserror::Error)]
enum Unasked {
    #[error("as many checks as --max-authorizer-checks allows are in flight already")]
    Busy,
    #[error("the check's URL {uri:?}: {source}")]
    Url {
        uri: String,
        source: http::uri::InvalidUri,
    },
    #[error("{uri}: {}", with_causes(.source))]
    Failed {
        uri: String,
        source: hyper_util::client::legacy::Error,
    },
    #[error("{uri}: no answer in time")]
    NoAnswer { uri: String },
    /// It answered, and the answer's head could not be read: never "could not be asked".
    #[error("{uri}: an answer that cannot be read: {}", with_causes(.source))]
    Unreadable {
        uri: String,
        source: hyper_util::client::legacy::Error,
    },
}

/// Whether a failed check got an answer's first bytes: hyper could not parse its head (a
/// malformed line, more headers than it keeps, a head over its buffer).
fn answer_started(error: &hyper_util::client::legacy::Error) -> bool {
    causes(error).any(|cause| {
        cause
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_parse)
    })
}

/// The errors behind `error`, nearest first.
fn causes<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(error.source(), |cause| cause.source())
}

/// The first `limit` bytes of `body`: what arrived of it by `deadline`, or before it broke
/// off; the rest is not read.
async fn read_prefix<B>(mut body: B, limit: usize, deadline: tokio::time::Instant) -> Bytes
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    let mut collected = bytes::BytesMut::new();
    while collected.len() < limit {
        let Ok(Some(Ok(frame))) = tokio::time::timeout_at(deadline, body.frame()).await else {
            break;
        };
        if let Ok(data) = frame.into_data() {
            let room = limit - collected.len();
            collected.extend_from_slice(&data[..data.len().min(room)]);
        }
    }
    collected.freeze()
}

/// An error with its causes, `: `-separated (hyper's own text says only "client error").
fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    for cause in causes(error) {
        text.push_str(": ");
        text.push_str(&cause.to_string());
    }
    text
}
