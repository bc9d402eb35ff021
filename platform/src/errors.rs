//! Error answers of eddy's HTTP surfaces. Each surface keeps its own body (`{"error": ...}` on the
//! event-bus, the gateway and the dispatcher admin API; Kyma's shape on the legacy route; a
//! Kubernetes `Status` on the resource API), and every one is an [`ErrorResponse`], so the headers
//! a status calls for are set in one place: `WWW-Authenticate: Bearer` on 401 (every eddy token
//! is a bearer token) and `Retry-After` on 503.

use axum::{
    Json,
    response::{IntoResponse, Response},
};
use http::{HeaderValue, StatusCode, header};
use serde_json::{Value, json};

/// Seconds a client should wait before retrying a 503 (or a partly stored batch).
pub const RETRY_AFTER_SECONDS: &str = "1";

/// An error answer: a status, a JSON body in the surface's format, and the headers the status
/// calls for.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorResponse {
    status: StatusCode,
    body: Value,
    retry_after: bool,
    /// The body is a string sent as `text/plain` (the answers Kyma's Istio gateway gives).
    plain_text: bool,
}

impl ErrorResponse {
    /// Any JSON body.
    pub fn new(status: StatusCode, body: Value) -> Self {
        Self {
            status,
            body,
            retry_after: status == StatusCode::SERVICE_UNAVAILABLE,
            plain_text: false,
        }
    }

    /// A `text/plain` body, word for word (Istio's `RBAC: access denied`, which clients written
    /// against Kyma's gateway compare).
    pub fn text(status: StatusCode, text: impl Into<String>) -> Self {
        Self {
            plain_text: true,
            ..Self::new(status, Value::String(text.into()))
        }
    }

    /// `{"error": message}`.
    pub fn message(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, json!({ "error": message.into() }))
    }

    /// A Kubernetes `Status` failure, as the resource API answers.
    pub fn kubernetes_status(
        status: StatusCode,
        reason: &str,
        message: &str,
        details: Option<Value>,
    ) -> Self {
        let mut body = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": status.as_u16(),
        });
        if let Some(details) = details {
            body["details"] = details;
        }
        Self::new(status, body)
    }

    /// Adds a member to the body (an object).
    pub fn with(mut self, name: &str, value: Value) -> Self {
        if let Some(object) = self.body.as_object_mut() {
            object.insert(name.to_owned(), value);
        }
        self
    }

    /// Asks the client to retry later whatever the status (a batch stored in part: 207).
    pub fn retry_after(mut self) -> Self {
        self.retry_after = true;
        self
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl IntoResponse for ErrorResponse {
    fn into_response(self) -> Response {
        let mut response = match (self.plain_text, self.body) {
            (true, Value::String(text)) => {
                (self.status, [(header::CONTENT_TYPE, "text/plain")], text).into_response()
            }
            (_, body) => (self.status, Json(body)).into_response(),
        };
        let headers = response.headers_mut();
        if self.retry_after {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use http_body_util::BodyExt as _;

    use super::*;

    async fn answer(error: ErrorResponse) -> (StatusCode, http::HeaderMap, Value) {
        let response = error.into_response();
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        (
            parts.status,
            parts.headers,
            serde_json::from_slice(&bytes).unwrap(),
        )
    }

    #[tokio::test]
    async fn unavailable_says_when_to_retry() {
        let (status, headers, body) = answer(ErrorResponse::message(
            StatusCode::SERVICE_UNAVAILABLE,
            "later",
        ))
        .await;
        assert_eq!(status, 503);
        assert_eq!(headers[header::RETRY_AFTER], "1");
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert!(headers.get(header::WWW_AUTHENTICATE).is_none());
        assert_eq!(body, json!({"error": "later"}));
    }

    #[tokio::test]
    async fn unauthorized_names_the_scheme() {
        let (status, headers, body) = answer(ErrorResponse::kubernetes_status(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "a token is required",
            None,
        ))
        .await;
        assert_eq!(status, 401);
        assert_eq!(headers[header::WWW_AUTHENTICATE], "Bearer");
        assert!(headers.get(header::RETRY_AFTER).is_none());
        assert_eq!(
            body,
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": "a token is required", "reason": "Unauthorized", "code": 401})
        );
    }

    #[tokio::test]
    async fn other_statuses_carry_only_their_body() {
        let (status, headers, body) = answer(
            ErrorResponse::message(StatusCode::BAD_REQUEST, "bad").with("field", json!("id")),
        )
        .await;
        assert_eq!(status, 400);
        assert!(headers.get(header::RETRY_AFTER).is_none());
        assert!(headers.get(header::WWW_AUTHENTICATE).is_none());
        assert_eq!(body, json!({"error": "bad", "field": "id"}));
        let (status, headers, _) = answer(
            ErrorResponse::new(StatusCode::MULTI_STATUS, json!({"results": []})).retry_after(),
        )
        .await;
        assert_eq!(status, 207);
        assert_eq!(headers[header::RETRY_AFTER], "1");
    }
}
