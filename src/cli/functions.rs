//! `eddy logs`, `eddy invoke` and `eddy init`.

use std::path::Path;

use anyhow::{Context as _, bail};
use eddy_model::resources::Function;
use serde_json::Value;
use std::io::Write as _;

use super::resources::ApiArgs;

fn function_url(api: &ApiArgs, name: &str) -> String {
    format!(
        "{}/apis/eddy.dev/v1alpha1/namespaces/{}/functions/{name}",
        api.server.trim_end_matches('/'),
        api.namespace
    )
}

/// `eddy logs FN [-f]`: the instances' output.
pub async fn logs(api: &ApiArgs, name: &str, follow: bool) -> anyhow::Result<()> {
    let url = format!("{}/log?follow={follow}", function_url(api, name));
    let response = api
        .http()?
        .get(&url)
        .send()
        .await
        .with_context(|| format!("cannot reach the eddy API at {}", api.server))?;
    if !response.status().is_success() {
        let body: Value = response.json().await.unwrap_or(Value::Null);
        bail!(
            "{}",
            body["message"].as_str().unwrap_or("cannot read the log")
        );
    }
    let mut response = response;
    let mut stdout = std::io::stdout();
    while let Some(chunk) = response.chunk().await.context("the log stream broke")? {
        stdout.write_all(&chunk)?;
        stdout.flush()?;
    }
    Ok(())
}

/// Flags of `eddy invoke`.
#[derive(Debug, clap::Args)]
pub struct InvokeArgs {
    /// The function.
    pub name: String,
    /// Request body (JSON unless --content-type says otherwise).
    #[arg(long, short = 'd')]
    pub data: Option<String>,
    /// HTTP method (default POST with --data, GET without).
    #[arg(long, short = 'X')]
    pub method: Option<String>,
    /// Path under the function, e.g. /orders/7?verbose=1.
    #[arg(long, default_value = "/")]
    pub path: String,
    /// Content type of --data.
    #[arg(long = "content-type", default_value = "application/json")]
    pub content_type: String,
    /// Extra headers as NAME:VALUE (repeatable).
    #[arg(long = "header", short = 'H')]
    pub headers: Vec<String>,
}

/// `eddy invoke FN`: calls the function at its `status.url` and prints the answer.
pub async fn invoke(api: &ApiArgs, args: InvokeArgs) -> anyhow::Result<()> {
    let InvokeArgs {
        name,
        data,
        method,
        path,
        content_type,
        headers,
    } = args;
    let response = api
        .http()?
        .get(function_url(api, &name))
        .send()
        .await
        .with_context(|| format!("cannot reach the eddy API at {}", api.server))?;
    if !response.status().is_success() {
        bail!("function {name} not found in namespace {}", api.namespace);
    }
    let function: Function = response
        .json()
        .await
        .context("the API answered something else than a function")?;
    let Some(base) = function.status.and_then(|status| status.url) else {
        bail!("function {name} has no URL yet: see `eddy get functions {name}`");
    };
    let method = method.unwrap_or_else(|| if data.is_some() { "POST" } else { "GET" }.to_owned());
    let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes())
        .context("invalid --method")?;
    let path = if path.starts_with('/') {
        path
    } else {
        format!("/{path}")
    };
    let mut request =
        reqwest::Client::new().request(method, format!("{}{path}", base.trim_end_matches('/')));
    for header in &headers {
        let (header_name, value) = header
            .split_once(':')
            .with_context(|| format!("`{header}` is not NAME:VALUE"))?;
        request = request.header(header_name.trim(), value.trim());
    }
    if let Some(data) = data {
        request = request.header("content-type", content_type).body(data);
    }
    let response = request
        .send()
        .await
        .with_context(|| format!("cannot reach {base}"))?;
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    println!("{body}");
    if !status.is_success() {
        bail!("the function answered {status}");
    }
    Ok(())
}

const NODE_TEMPLATE: &str = r#"// Called for every request and every event delivered to this function.
// event.data: the body (parsed JSON); event["ce-type"] etc.: CloudEvents attributes.
module.exports = {
  main: async function (event, context) {
    console.log(`${context["function-name"]} got`, event["ce-type"] || "a request");
    return { hello: "from " + context["function-name"], received: event.data ?? null };
  },
};
"#;

const PYTHON_TEMPLATE: &str = r#"# Called for every request and every event delivered to this function.
# event["data"]: the body (parsed JSON); event["ce-type"] etc.: CloudEvents attributes.
def main(event, context):
    print(context["function-name"], "got", event.get("ce-type", "a request"), flush=True)
    return {"hello": "from " + context["function-name"], "received": event["data"]}
"#;

const NODE_REQUEST_TEMPLATE: &str = r#"// Called for every request and every event delivered to this function, with Express's request
// and response (Kyma's new runtime API). sdk.getCloudEvent(req): the CloudEvent, or null.
const sdk = require("sdk");

module.exports = {
  main: async function (req, res) {
    const event = sdk.getCloudEvent(req);
    console.log(`${sdk.getFunctionName()} got`, event ? event.type : "a request");
    res.json({ hello: "from " + sdk.getFunctionName(), received: event ? event.data : req.body ?? null });
  },
};
"#;

const PYTHON_REQUEST_TEMPLATE: &str = r#"# Called for every request and every event delivered to this function; the request is Flask's
# (Kyma's new runtime API). sdk.get_cloud_event(): the CloudEvent, or None.
import flask
import sdk


def main():
    event = sdk.get_cloud_event()
    print(sdk.get_function_name(), "got", event.get_type() if event else "a request", flush=True)
    received = event.get_data() if event else flask.request.get_json(silent=True)
    return {"hello": "from " + sdk.get_function_name(), "received": received}
"#;

/// The manifest `eddy init` writes. Pure.
pub fn init_manifest(name: &str, runtime: &str, namespace: &str) -> anyhow::Result<String> {
    let source = match runtime {
        "nodejs20" | "nodejs22" | "nodejs24" => NODE_TEMPLATE,
        "nodejs26" => NODE_REQUEST_TEMPLATE,
        "python311" | "python312" => PYTHON_TEMPLATE,
        "python314" => PYTHON_REQUEST_TEMPLATE,
        other => bail!(
            "unknown runtime {other:?}: use {}",
            eddy_model::resources::Runtime::NAMES
        ),
    };
    if !eddy_model::resources::is_dns1035_label(name) {
        bail!(
            "{name:?} is not a valid function name: lower-case letters, digits and '-', starting with a letter"
        );
    }
    let indented: String = source
        .lines()
        .map(|line| {
            if line.is_empty() {
                "\n".to_owned()
            } else {
                format!("        {line}\n")
            }
        })
        .collect();
    Ok(format!(
        "apiVersion: eddy.dev/v1alpha1\nkind: Function\nmetadata:\n  name: {name}\n  namespace: {namespace}\nspec:\n  runtime: {runtime}\n  source:\n    inline:\n      source: |\n{indented}      dependencies: \"\"\n  scaleConfig: {{minReplicas: 1, maxReplicas: 3}}\n  timeoutSeconds: 30\n"
    ))
}

/// `eddy init NAME --runtime R`: writes `NAME/function.yaml`.
pub fn init(name: &str, runtime: &str, namespace: &str, dir: &Path) -> anyhow::Result<()> {
    let manifest = init_manifest(name, runtime, namespace)?;
    let folder = dir.join(name);
    let file = folder.join("function.yaml");
    if file.exists() {
        bail!("{} exists already", file.display());
    }
    std::fs::create_dir_all(&folder)
        .with_context(|| format!("cannot create {}", folder.display()))?;
    std::fs::write(&file, manifest).with_context(|| format!("cannot write {}", file.display()))?;
    println!("wrote {}", file.display());
    println!("deploy it with: eddy apply -f {}", file.display());
    println!("then call it:   eddy invoke {name} --data '{{\"hi\": 1}}'");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_writes_a_valid_function() {
        for runtime in ["nodejs20", "python311"] {
            let manifest = init_manifest("hello", runtime, "default").unwrap();
            let value: Value = serde_yaml_ng::from_str(&manifest).unwrap();
            let function: eddy_model::resources::Function = serde_json::from_value(value).unwrap();
            assert!(eddy_model::resources::validate_function(&function).is_empty());
            let source = &function.spec.source.inline.unwrap().source;
            assert!(source.contains("main"), "{source}");
        }
        assert!(init_manifest("Hello", "nodejs20", "default").is_err());
        assert!(init_manifest("hello", "cobol", "default").is_err());
    }
}
