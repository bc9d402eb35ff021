//! What eddy's two gateways share (the local one in `local::gateway`, the Kubernetes one in
//! `kubernetes::gateway`): the `/{namespace}/{function}/{rest}` route, who may call a Function
//! ([`Access`], from its `spec.access`), reading a request within the limits and forwarding
//! its headers, the JWT refusal, call traces and the `/metrics` answer.

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    extract::Request,
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use eddy_model::resources::{AccessMode, Function, is_dns1035_label, is_dns1123_label};
use eddy_platform::{
    errors::ErrorResponse,
    net::{BodyError, read_limited},
    traces,
};

/// Who may invoke a function through the gateway.
#[derive(Debug, Clone, Default)]
pub enum Access {
    /// Anyone who reaches the gateway.
    #[default]
    Public,
    /// Callers with one of these bearer tokens.
    Tokens(Arc<eddy_platform::auth::Tokens>),
    /// Callers with a valid bearer JWT.
    Jwt(Arc<crate::jwt::JwtVerifier>),
}

impl Access {
    /// A Function's access (a JWT verifier for an unchanged `access.jwt` in `existing` is kept,
    /// with its keys).
    pub fn of(function: &Function, existing: Option<Access>) -> Access {
        let Some(access) = function.spec.access.as_ref() else {
            return Access::Public;
        };
        match (access.mode, &access.jwt) {
            (AccessMode::Jwt, Some(jwt)) => {
                if let Some(Access::Jwt(verifier)) = existing
                    && verifier.spec() == jwt
                {
                    return Access::Jwt(verifier);
                }
                match crate::jwt::JwtVerifier::new(jwt.clone()) {
                    Ok(verifier) => Access::Jwt(Arc::new(verifier)),
                    Err(error) => {
                        // No TLS roots: nothing can be verified, so nobody is let in.
                        tracing::error!(%error, "cannot set up JWT verification; the function refuses every call");
                        Access::Tokens(Arc::new(eddy_platform::auth::Tokens::from_digests(
                            Vec::new(),
                        )))
                    }
                }
            }
            _ => match access.digests() {
                Some(digests) => {
                    Access::Tokens(Arc::new(eddy_platform::auth::Tokens::from_digests(digests)))
                }
                None => Access::Public,
            },
        }
    }
}

/// Longest a request body may take to arrive (a slow client holds no instance meanwhile).
const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// The `/metrics` answer of a gateway.
pub fn metrics_text(text: String) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// With traces on, every call to a function is a server span that continues the caller's
/// trace, and the function's spans are its children. Without, the router is left as it is.
pub fn with_call_traces(router: Router) -> Router {
    if traces::enabled() {
        router.layer(axum::middleware::from_fn(trace_call))
    } else {
        router
    }
}

async fn trace_call(request: Request, next: axum::middleware::Next) -> Response {
    let Some((namespace, function, _)) = route(request.uri().path()) else {
        return next.run(request).await;
    };
    let span = tracing::info_span!(
        target: traces::TARGET,
        "call",
        otel.kind = "server",
        eddy.namespace = namespace,
        eddy.function = function,
        http.request.method = %request.method(),
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    traces::serve_request(span, request, async |request| next.run(request).await).await
}

/// Splits `/{namespace}/{function}/{rest}` (raw, still percent-encoded) into its parts.
pub fn route(path: &str) -> Option<(&str, &str, &str)> {
    let path = path.strip_prefix('/')?;
    let (namespace, after) = path.split_once('/')?;
    let (function, rest) = match after.find('/') {
        Some(slash) => (&after[..slash], &after[slash..]),
        None => (after, "/"),
    };
    (is_dns1123_label(namespace) && is_dns1035_label(function))
        .then_some((namespace, function, rest))
}

/// Headers that belong to one connection and are not forwarded.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

/// Drops the hop-by-hop headers (and those `Connection` names) of a request or an answer.
pub fn forward_headers(headers: &mut HeaderMap) {
    if let Some(listed) = headers
        .get(header::CONNECTION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    {
        for name in listed.split(',') {
            if let Ok(name) = HeaderName::from_bytes(name.trim().as_bytes()) {
                headers.remove(name);
            }
        }
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove(header::TRANSFER_ENCODING);
}

/// Checks a caller's JWT; the refusal (401 with `WWW-Authenticate: Bearer`, 403, 503) names
/// the function and what failed.
pub async fn check_jwt(
    verifier: &crate::jwt::JwtVerifier,
    headers: &HeaderMap,
    namespace: &str,
    function: &str,
) -> Result<(), Response> {
    // A 401 says `WWW-Authenticate: Bearer` (ErrorResponse adds it).
    match verifier.check(headers).await {
        Ok(_) => Ok(()),
        Err(refusal) => Err(ErrorResponse::message(
            refusal.status,
            format!("function {namespace}/{function}: {}", refusal.message),
        )
        .into_response()),
    }
}

/// Reads the body (within the gateway's limits) and sets the headers the function sees.
pub async fn read_request(
    max_body: usize,
    request: Request,
    platform_call: bool,
) -> Result<(http::request::Parts, Bytes), ErrorResponse> {
    let (mut parts, body) = request.into_parts();
    if platform_call {
        parts.headers.remove(header::AUTHORIZATION);
    }
    // However slowly it arrives, the body is read within the gateway's request timeout.
    let collected = tokio::time::timeout(BODY_TIMEOUT, read_limited(body, max_body)).await;
    let body = match collected {
        Ok(Ok(body)) => body,
        Err(_) | Ok(Err(BodyError::Stalled)) => {
            return Err(ErrorResponse::message(
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time",
            ));
        }
        Ok(Err(BodyError::TooLarge)) => {
            return Err(ErrorResponse::message(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body is over {max_body} bytes"),
            ));
        }
        Ok(Err(BodyError::Unreadable(problem))) => {
            return Err(ErrorResponse::message(
                StatusCode::BAD_REQUEST,
                format!("cannot read the request body: {problem}"),
            ));
        }
    };
    // HTTP/1.1 names the host in `Host`, HTTP/2 in the URI (`:authority`).
    let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|authority| HeaderValue::from_str(authority.as_str()).ok())
    });
    forward_headers(&mut parts.headers);
    if let Some(host) = original_host {
        parts
            .headers
            .insert(HeaderName::from_static("x-forwarded-host"), host);
    }
    parts.headers.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
    if traces::enabled() {
        // The function continues the trace from the gateway's `call` span.
        traces::inject_http(&tracing::Span::current(), &mut parts.headers);
    }
    Ok((parts, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_split_namespace_function_and_rest() {
        assert_eq!(route("/default/hello"), Some(("default", "hello", "/")));
        assert_eq!(route("/default/hello/"), Some(("default", "hello", "/")));
        assert_eq!(
            route("/shop/stock/items/42"),
            Some(("shop", "stock", "/items/42"))
        );
        assert_eq!(
            route("/shop/stock/a%2Fb"),
            Some(("shop", "stock", "/a%2Fb"))
        );
        assert_eq!(route("/default"), None);
        assert_eq!(route("/Default/hello"), None);
        assert_eq!(route("/default/.."), None);
        assert_eq!(route("/default/hello%2F..%2Fother"), None);
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, "keep-alive, x-secret".parse().unwrap());
        headers.insert("x-secret", "1".parse().unwrap());
        headers.insert("keep-alive", "timeout=5".parse().unwrap());
        headers.insert("ce-id", "1".parse().unwrap());
        forward_headers(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key("ce-id"));
    }
}
