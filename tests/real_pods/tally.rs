//! Two Functions that count deliveries by event id, for the tests that must account for every
//! event: `worker` (nodejs22) answers each `<prefix>.work.v1` with a `<prefix>.done.v1` reply
//! carrying the event's id, and `tally` (python312, one replica, never deleted or scaled) counts
//! each id it receives and answers the counts to a GET.

use std::collections::HashMap;

use anyhow::{Context as _, Result, ensure};
use serde_json::Value;

use super::*;

/// How the worker runs.
pub struct Worker<'a> {
    /// Its scaling fields, one YAML line of its spec (`replicas: 2`, or a `scaleConfig`).
    pub scaling: &'a str,
    /// Its `dependencies` (a package.json), or none.
    pub dependencies: Option<&'a str>,
    /// The Subscriptions' `maxInFlightMessages`, or their default.
    pub max_in_flight: Option<u32>,
    /// Its `metadata.annotations`, a YAML flow mapping (`{eddy.dev/scale-on: backlog}`).
    pub annotations: Option<&'a str>,
}

/// The manifest of the worker, the tally and their two Subscriptions in `namespace`.
pub fn worker_and_tally(namespace: &str, prefix: &str, worker: &Worker<'_>) -> String {
    let Worker {
        scaling,
        dependencies,
        max_in_flight,
        annotations,
    } = worker;
    let annotations = annotations
        .map(|annotations| format!(", annotations: {annotations}"))
        .unwrap_or_default();
    let dependencies = dependencies
        .map(|package| format!("\n      dependencies: '{package}'"))
        .unwrap_or_default();
    let config = max_in_flight
        .map(|limit| format!("\n  config: {{maxInFlightMessages: \"{limit}\"}}"))
        .unwrap_or_default();
    format!(
        r#"
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: worker{annotations}}}
spec:
  runtime: nodejs22
  {scaling}
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:{dependencies}
      source: |
        module.exports = {{
          main: (event) => {{
            const id = event["ce-id"] || (event.data && event.data.id) || "call";
            const response = event.extensions.response;
            response.setHeader("ce-specversion", "1.0");
            response.setHeader("ce-type", "{prefix}.done.v1");
            response.setHeader("ce-source", "worker");
            response.setHeader("ce-id", `${{id}}-done`);
            return {{ id }};
          }},
        }};
---
apiVersion: eddy.dev/v1alpha1
kind: Function
metadata: {{name: tally}}
spec:
  runtime: python312
  replicas: 1
  resourceConfiguration: {{function: {{profile: XS}}}}
  source:
    inline:
      source: |
        import threading

        COUNTS = {{}}
        LOCK = threading.Lock()


        def main(event, context):
            if event.get("ce-type") == "{prefix}.done.v1":
                with LOCK:
                    id = event["data"]["id"]
                    COUNTS[id] = COUNTS.get(id, 0) + 1
                return "ok"
            with LOCK:
                return {{"counts": dict(COUNTS)}}
---
apiVersion: eddy.dev/v1alpha1
kind: Subscription
metadata: {{name: work}}
spec:
  sink: http://worker.{namespace}.svc.cluster.local
  types: [{prefix}.work.v1]{config}
---
apiVersion: eddy.dev/v1alpha1
kind: Subscription
metadata: {{name: done}}
spec:
  sink: http://tally.{namespace}.svc.cluster.local
  types: [{prefix}.done.v1]{config}
"#
    )
}

/// How many times the tally received each id, read through eddy's gateway.
pub fn tallied(plane: &ControlPlane, namespace: &str) -> Result<HashMap<String, u64>> {
    let (status, body) = call(
        plane,
        SYSTEM,
        "eddy-gateway",
        &format!("/{namespace}/tally/"),
        None,
    )?;
    ensure!(status == 200, "the tally answered {status}: {body}");
    let answer: Value = serde_json::from_str(&body).with_context(|| body.clone())?;
    Ok(answer["counts"]
        .as_object()
        .context("counts")?
        .iter()
        .map(|(id, count)| (id.clone(), count.as_u64().unwrap_or(0)))
        .collect())
}
