//! Helpers of the tests of Kyma's function contract: deploying a handler on a runtime, and
//! reading an answer.

use serde_json::{Value, json};

use super::Platform;

/// Deploys `source` on `runtime` as `name`, with `extra` merged into the spec (its
/// `dependencies` go to the inline source).
pub async fn deploy_on(platform: &Platform, runtime: &str, name: &str, source: &str, extra: Value) {
    let mut spec = json!({"runtime": runtime, "source": {"inline": {"source": source}}});
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        for (key, value) in extra {
            if key == "dependencies" {
                spec["source"]["inline"]["dependencies"] = value.clone();
            } else {
                spec.insert(key.clone(), value.clone());
            }
        }
    }
    platform.deploy(name, spec).await;
}

/// An answer's status and body.
pub async fn text(response: reqwest::Response) -> (u16, String) {
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// The JSON a request's successful answer carries (any other answer fails the test, with its
/// status and body).
pub async fn json_answer(request: reqwest::RequestBuilder) -> Value {
    let response = request.send().await.unwrap();
    let status = response.status();
    let body = response.text().await.unwrap();
    assert!(status.is_success(), "{status}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|_| panic!("not JSON: {body}"))
}

/// Kyma's RateLimit sample of "Path and header-based rate limit configuration" (api-gateway's
/// docs, "Configuring Local Rate Limiting"), as written but for the namespace, which the apply
/// gives.
#[allow(dead_code)]
pub const RATELIMIT_PATH_HEADER_SAMPLE: &str = "apiVersion: gateway.kyma-project.io/v1alpha1
kind: RateLimit
metadata:
  labels:
    app: httpbin
  name: ratelimit-path-header-sample
spec:
  selectorLabels:
    app: httpbin
  enableResponseHeaders: true
  local:
    defaultBucket:
      maxTokens: 1
      tokensPerFill: 1
      fillInterval: 30s
    buckets:
      - headers:
          X-Rate-Limited: \"true\"
        path: /headers
        bucket:
          maxTokens: 10
          tokensPerFill: 5
          fillInterval: 30s
";
