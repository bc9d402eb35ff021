//! `eddy apply`, `eddy get`, `eddy delete`: resources through the controller API.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use eddy_model::{
    apirule::APIRule,
    conditions::ConditionType,
    resources::{Condition, ConditionStatus, Function, Subscription},
};
use serde_json::Value;

/// Where the API is and which namespace to use.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiArgs {
    /// The controller API.
    #[arg(
        long = "server",
        env = "EDDY_SERVER",
        default_value = "http://127.0.0.1:8082",
        global = true
    )]
    pub server: String,
    /// Namespace of the resources named on the command line.
    #[arg(
        long = "namespace",
        short = 'n',
        env = "EDDY_NAMESPACE",
        default_value = "default",
        global = true
    )]
    pub namespace: String,
    /// Bearer token for the controller API and the dispatcher's admin API, when they require one.
    #[arg(
        long = "token",
        env = "EDDY_TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub token: Option<String>,
}

impl ApiArgs {
    /// An HTTP client that sends the token, if any, with every request.
    pub fn http(&self) -> anyhow::Result<reqwest::Client> {
        super::http_client(self.token.as_deref())
    }
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// A table for people.
    Table,
    /// JSON.
    Json,
    /// YAML.
    Yaml,
}

/// Resource kinds on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Functions.
    #[value(alias = "function", alias = "fn")]
    Functions,
    /// Subscriptions.
    #[value(alias = "subscription", alias = "sub")]
    Subscriptions,
    /// Secrets (values are never shown).
    #[value(alias = "secret")]
    Secrets,
    /// ConfigMaps.
    #[value(alias = "configmap", alias = "cm")]
    Configmaps,
    /// Kyma's APIRules: the hosts that expose functions, and who may call them.
    #[value(alias = "apirule")]
    Apirules,
    /// Kyma's Istio resource: the external authorizers APIRules may name.
    #[value(alias = "istio")]
    Istios,
    /// Kyma's RateLimits: token buckets for the calls to the Functions they select.
    #[value(alias = "ratelimit")]
    Ratelimits,
    /// The running instances of one function (name the function).
    #[value(alias = "instance", alias = "pods")]
    Instances,
}

impl Kind {
    fn plural(self) -> &'static str {
        match self {
            Self::Functions => "functions",
            Self::Subscriptions => "subscriptions",
            Self::Secrets => "secrets",
            Self::Configmaps => "configmaps",
            Self::Apirules => "apirules",
            Self::Istios => "istios",
            Self::Ratelimits => "ratelimits",
            Self::Instances => "instances",
        }
    }

    /// `function.eddy.dev/NAME`, `secret/NAME`: how `apply` and `delete` name what they did.
    fn label(self, name: &str) -> String {
        match self {
            Self::Functions => format!("function.eddy.dev/{name}"),
            Self::Subscriptions => format!("subscription.eddy.dev/{name}"),
            Self::Secrets => format!("secret/{name}"),
            Self::Configmaps => format!("configmap/{name}"),
            Self::Apirules => format!("apirule.gateway.kyma-project.io/{name}"),
            Self::Istios => format!("istio.operator.kyma-project.io/{name}"),
            Self::Ratelimits => format!("ratelimit.gateway.kyma-project.io/{name}"),
            Self::Instances => format!("instances of {name}"),
        }
    }

    /// The API path the kind lives under.
    fn api_path(self) -> &'static str {
        match self {
            Self::Functions | Self::Subscriptions | Self::Instances => "apis/eddy.dev/v1alpha1",
            Self::Secrets | Self::Configmaps => "api/v1",
            Self::Apirules => "apis/gateway.kyma-project.io/v2",
            Self::Istios => "apis/operator.kyma-project.io/v1alpha2",
            Self::Ratelimits => "apis/gateway.kyma-project.io/v1alpha1",
        }
    }

    fn from_manifest(kind: &str) -> Option<Self> {
        match kind {
            "Function" => Some(Self::Functions),
            "Subscription" => Some(Self::Subscriptions),
            "Secret" => Some(Self::Secrets),
            "ConfigMap" => Some(Self::Configmaps),
            "APIRule" => Some(Self::Apirules),
            "Istio" => Some(Self::Istios),
            "RateLimit" => Some(Self::Ratelimits),
            _ => None,
        }
    }
}

fn resource_url(server: &str, namespace: &str, kind: Kind, name: Option<&str>) -> String {
    if kind == Kind::Instances {
        return format!(
            "{}/{}/namespaces/{namespace}/functions/{}/instances",
            server.trim_end_matches('/'),
            kind.api_path(),
            name.unwrap_or_default()
        );
    }
    let base = format!(
        "{}/{}/namespaces/{namespace}/{}",
        server.trim_end_matches('/'),
        kind.api_path(),
        kind.plural()
    );
    match name {
        Some(name) => format!("{base}/{name}"),
        None => base,
    }
}

/// Reads every manifest in a file (several YAML documents allowed), a directory (its `.yaml`,
/// `.yml` and `.json` files, sorted), or standard input for `-` (as kubectl does: Kyma's
/// tutorials apply with `cat <<EOF | kubectl apply -f -`).
pub fn read_manifests(path: &Path) -> anyhow::Result<Vec<Value>> {
    if path == Path::new("-") {
        use std::io::Read as _;
        let mut text = String::new();
        std::io::stdin()
            .take(MAX_MANIFEST_BYTES + 1)
            .read_to_string(&mut text)
            .context("cannot read standard input")?;
        if text.len() as u64 > MAX_MANIFEST_BYTES {
            anyhow::bail!("standard input holds more than {MAX_MANIFEST_BYTES} bytes of manifests");
        }
        return parse_manifests(&text, "standard input");
    }
    let mut files = Vec::new();
    if path.is_dir() {
        for entry in
            std::fs::read_dir(path).with_context(|| format!("cannot read {}", path.display()))?
        {
            let file = entry?.path();
            if file
                .extension()
                .is_some_and(|ext| ext == "yaml" || ext == "yml" || ext == "json")
            {
                files.push(file);
            }
        }
        files.sort();
    } else {
        files.push(path.to_path_buf());
    }
    let mut manifests = Vec::new();
    for file in files {
        let size = std::fs::metadata(&file)
            .with_context(|| format!("cannot read {}", file.display()))?
            .len();
        if size > MAX_MANIFEST_BYTES {
            anyhow::bail!(
                "{} is {size} bytes; manifests are at most {MAX_MANIFEST_BYTES}",
                file.display()
            );
        }
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("cannot read {}", file.display()))?;
        manifests.extend(parse_manifests(&text, &file.display().to_string())?);
    }
    Ok(manifests)
}

/// The manifests of one YAML text (several documents allowed); `origin` names it in errors.
fn parse_manifests(text: &str, origin: &str) -> anyhow::Result<Vec<Value>> {
    check_structure(text, origin)?;
    let mut manifests = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_str(text) {
        let value: Value = serde::Deserialize::deserialize(document)
            .with_context(|| format!("{origin} is not valid YAML"))?;
        if !value.is_null() {
            manifests.push(value);
        }
    }
    Ok(manifests)
}

/// Largest manifest file read.
const MAX_MANIFEST_BYTES: u64 = 8 * 1024 * 1024;
/// Deepest nesting of collections (block or flow) a manifest may have; real ones have under
/// twenty.
const MAX_NESTING: usize = 64;

/// What a YAML text must be before the YAML parser that reads it into values sees it:
/// collections nested at most [`MAX_NESTING`] deep (that parser takes minutes over 200,000
/// nested `[`: quadratic), and no key twice in one mapping (the parser would keep the last one
/// without a word; kubectl refuses it). Read by a streaming parser that stops at the first
/// problem, so a hostile text costs a moment: the parser itself decides what is quoted, a
/// comment or a block scalar, where a scan of the text would have to guess.
fn check_structure(text: &str, origin: &str) -> anyhow::Result<()> {
    use saphyr_parser::{Event, Parser};
    /// A collection being read: a sequence, or a mapping with the keys it has had and whether
    /// its next node is a key.
    enum Open {
        Sequence,
        Mapping {
            keys: std::collections::HashSet<String>,
            key_next: bool,
        },
    }
    /// A node read into the innermost collection: a key of a mapping must be new (`key`: its
    /// text, when it is a scalar).
    fn node(open: &mut [Open], key: Option<&str>, line: usize) -> anyhow::Result<()> {
        if let Some(Open::Mapping { keys, key_next }) = open.last_mut() {
            if *key_next
                && let Some(key) = key
                && !keys.insert(key.to_owned())
            {
                anyhow::bail!("line {line}: the key {key:?} appears twice in one mapping");
            }
            *key_next = !*key_next;
        }
        Ok(())
    }
    let mut open: Vec<Open> = Vec::new();
    for event in Parser::new_from_str(text) {
        let (event, span) = event.map_err(|error| {
            // The parser reads a little ahead, and its own depth limit may come first.
            if error.info().contains("recursion limit") {
                anyhow::anyhow!(
                    "{origin} is not a manifest: collections are nested deeper than \
                     {MAX_NESTING} levels"
                )
            } else {
                anyhow::anyhow!("{origin} is not valid YAML: {error}")
            }
        })?;
        let line = span.start.line();
        match event {
            Event::DocumentStart(_) => open.clear(),
            Event::Scalar(value, ..) => node(&mut open, Some(value.as_ref()), line)
                .with_context(|| format!("{origin} is not a manifest"))?,
            Event::Alias(_) => node(&mut open, None, line)?,
            Event::SequenceStart(..) | Event::MappingStart(..) => {
                node(&mut open, None, line)?;
                if open.len() == MAX_NESTING {
                    anyhow::bail!(
                        "{origin} is not a manifest: line {line}: collections are nested deeper \
                         than {MAX_NESTING} levels"
                    );
                }
                open.push(match event {
                    Event::SequenceStart(..) => Open::Sequence,
                    _ => Open::Mapping {
                        keys: std::collections::HashSet::new(),
                        key_next: true,
                    },
                });
            }
            Event::SequenceEnd | Event::MappingEnd => {
                open.pop();
            }
            _ => {}
        }
    }
    Ok(())
}

fn identify(manifest: &Value, default_namespace: &str) -> anyhow::Result<(Kind, String, String)> {
    let kind_text = manifest["kind"].as_str().unwrap_or_default();
    let kind = Kind::from_manifest(kind_text).with_context(|| {
        format!(
            "unknown kind {kind_text:?}: eddy knows Function, Subscription, APIRule, \
             RateLimit, Istio, Secret and ConfigMap"
        )
    })?;
    let name = manifest["metadata"]["name"]
        .as_str()
        .context("a manifest has no metadata.name")?
        .to_owned();
    let namespace = manifest["metadata"]["namespace"]
        .as_str()
        .unwrap_or(default_namespace)
        .to_owned();
    Ok((kind, namespace, name))
}

/// Explains an API refusal: the message and each bad field.
async fn refusal(response: reqwest::Response) -> String {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    let mut text = body["message"]
        .as_str()
        .map_or_else(|| format!("the API answered {status}"), str::to_owned);
    if let Some(causes) = body["details"]["causes"].as_array()
        && !causes.is_empty()
    {
        text = format!(
            "{} is invalid:",
            body["details"]["name"].as_str().unwrap_or("resource")
        );
        for cause in causes {
            text.push_str(&format!(
                "\n  {}: {}",
                cause["field"].as_str().unwrap_or("?"),
                cause["message"].as_str().unwrap_or("?")
            ));
        }
    }
    text
}

/// `eddy apply -f FILE|DIR`.
pub async fn apply(api: &ApiArgs, path: &Path) -> anyhow::Result<()> {
    let manifests = read_manifests(path)?;
    if manifests.is_empty() {
        bail!("no manifests in {}", path.display());
    }
    let http = api.http()?;
    let mut targets = Vec::with_capacity(manifests.len());
    for manifest in &manifests {
        targets.push(identify(manifest, &api.namespace)?);
    }
    // Every document is checked first (`dryRun=All`): one refused document refuses the file
    // before anything in it is applied.
    let mut refused = 0;
    for (manifest, (kind, namespace, name)) in manifests.iter().zip(&targets) {
        let url = resource_url(&api.server, namespace, *kind, Some(name));
        let response = http
            .put(format!("{url}?dryRun=All"))
            .json(manifest)
            .send()
            .await
            .with_context(|| format!("cannot reach the eddy API at {}", api.server))?;
        if !response.status().is_success() {
            refused += 1;
            eprintln!("{}: {}", kind.label(name), refusal(response).await);
        }
    }
    if refused > 0 {
        bail!("{refused} manifest(s) were refused; nothing was applied");
    }
    let mut failed = 0;
    for (manifest, (kind, namespace, name)) in manifests.into_iter().zip(targets) {
        let url = resource_url(&api.server, &namespace, kind, Some(&name));
        let previous: Option<Value> = match http.get(&url).send().await {
            Ok(response) if response.status().is_success() => response.json().await.ok(),
            Ok(_) => None,
            Err(error) => {
                return Err(error)
                    .with_context(|| format!("cannot reach the eddy API at {}", api.server));
            }
        };
        let response = http
            .put(&url)
            .json(&manifest)
            .send()
            .await
            .with_context(|| format!("cannot reach {url}"))?;
        let label = kind.label(&name);
        if response.status().is_success() {
            for warning in response.headers().get_all(reqwest::header::WARNING) {
                if let Ok(text) = warning.to_str() {
                    eprintln!("Warning: {label}: {}", warning_text(text));
                }
            }
            let stored: Value = response.json().await.unwrap_or(Value::Null);
            let verb = match previous {
                None => "created",
                Some(previous)
                    if previous["metadata"]["generation"] == stored["metadata"]["generation"] =>
                {
                    "unchanged"
                }
                Some(_) => "configured",
            };
            println!("{label} {verb}");
        } else {
            failed += 1;
            eprintln!("{label}: {}", refusal(response).await);
        }
    }
    if failed > 0 {
        bail!("{failed} manifest(s) were refused");
    }
    Ok(())
}

/// The text of a `Warning` header (`299 - "text"`).
fn warning_text(header: &str) -> &str {
    header
        .splitn(3, ' ')
        .nth(2)
        .map_or(header, |text| text.trim_matches('"'))
}

/// How often `eddy get -w` asks the API.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// `eddy get KIND [NAME]`; with `watch`, then a row (or, with `-o json|yaml`, a document) for
/// each resource that appears or changes, as `kubectl get -w` prints them, until interrupted.
pub async fn get(
    api: &ApiArgs,
    kind: Kind,
    name: Option<&str>,
    all_namespaces: bool,
    output: Output,
    watch: bool,
) -> anyhow::Result<()> {
    if kind == Kind::Instances && name.is_none() {
        bail!("name the function: `eddy get instances FUNCTION`");
    }
    let url = if all_namespaces && name.is_none() {
        format!(
            "{}/{}/{}",
            api.server.trim_end_matches('/'),
            kind.api_path(),
            kind.plural()
        )
    } else {
        resource_url(&api.server, &api.namespace, kind, name)
    };
    let http = api.http()?;
    let body = read(&http, &url, api).await?;
    if !watch {
        match output {
            Output::Json => println!("{}", serde_json::to_string_pretty(&body)?),
            Output::Yaml => print!("{}", serde_yaml_ng::to_string(&body)?),
            Output::Table => print!("{}", table(kind, body)?),
        }
        return Ok(());
    }
    watch_changes(&http, &url, api, kind, output, body).await
}

async fn read(http: &reqwest::Client, url: &str, api: &ApiArgs) -> anyhow::Result<Value> {
    let response = http
        .get(url)
        .send()
        .await
        .with_context(|| format!("cannot reach the eddy API at {}", api.server))?;
    if !response.status().is_success() {
        bail!("{}", refusal(response).await);
    }
    Ok(response.json().await?)
}

/// Each item of a list (or the one resource) by `namespace/name`.
fn items_by_key(body: &Value) -> Vec<(String, Value)> {
    let items = match body.get("items").and_then(Value::as_array) {
        Some(items) => items.clone(),
        None => vec![body.clone()],
    };
    items
        .into_iter()
        .map(|item| {
            let key = format!(
                "{}/{}",
                item["metadata"]["namespace"].as_str().unwrap_or_default(),
                item["metadata"]["name"].as_str().unwrap_or_default()
            );
            (key, item)
        })
        .collect()
}

/// Prints what there is, then what changes, until Ctrl-C.
async fn watch_changes(
    http: &reqwest::Client,
    url: &str,
    api: &ApiArgs,
    kind: Kind,
    output: Output,
    first: Value,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    // What was last printed of each resource: its row, or its document.
    let mut shown: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let header = table_rows(kind, serde_json::json!({ "items": [] }))?.swap_remove(0);
    // Columns grow to fit what is printed, never shrink: rows printed earlier stay aligned.
    let mut widths: Vec<usize> = header.iter().map(|cell| cell.chars().count()).collect();
    let mut body = first;
    let mut header_printed = output != Output::Table;
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    loop {
        let mut out = String::new();
        for (key, item) in items_by_key(&body) {
            let printed = match output {
                Output::Table => {
                    let rows = table_rows(kind, serde_json::json!({ "items": [item] }))?;
                    let Some(row) = rows.get(1) else { continue };
                    for (column, cell) in row.iter().enumerate() {
                        if let Some(width) = widths.get_mut(column) {
                            *width = (*width).max(cell.chars().count());
                        }
                    }
                    aligned(row, &widths)
                }
                Output::Json => format!("{}\n", serde_json::to_string(&item)?),
                Output::Yaml => format!("---\n{}", serde_yaml_ng::to_string(&item)?),
            };
            if shown.get(&key) != Some(&printed) {
                out.push_str(&printed);
                shown.insert(key, printed);
            }
        }
        if !header_printed {
            // Once, above the first rows (or alone, saying what will come).
            out.insert_str(0, &aligned(&header, &widths));
            header_printed = true;
        }
        if !out.is_empty() {
            let mut stdout = std::io::stdout().lock();
            // The reader went away (a closed pipe): stop watching.
            if stdout
                .write_all(out.as_bytes())
                .and_then(|()| stdout.flush())
                .is_err()
            {
                return Ok(());
            }
        }
        tokio::select! {
            _ = &mut stop => return Ok(()),
            () = tokio::time::sleep(WATCH_EVERY) => {}
        }
        body = read(http, url, api).await?;
    }
}

/// One row padded to `widths`, three spaces between columns.
fn aligned(row: &[String], widths: &[usize]) -> String {
    let line: Vec<String> = row
        .iter()
        .enumerate()
        .map(|(c, cell)| {
            format!(
                "{cell:<width$}",
                width = widths.get(c).copied().unwrap_or(0)
            )
        })
        .collect();
    format!("{}\n", line.join("   ").trim_end())
}

/// One resource or a list of them, as the API answers.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum OneOrList<T> {
    List { items: Vec<T> },
    One(Box<T>),
}

impl<T> OneOrList<T> {
    fn into_items(self) -> Vec<T> {
        match self {
            Self::List { items } => items,
            Self::One(item) => vec![*item],
        }
    }
}

/// `True`, or the status and its reason.
fn condition(conditions: &[Condition], type_: ConditionType) -> String {
    conditions
        .iter()
        .find(|c| c.type_ == type_.as_str())
        .map(|c| {
            if c.status == ConditionStatus::True {
                c.status.to_string()
            } else {
                format!("{} ({})", c.status, c.reason)
            }
        })
        .unwrap_or_else(|| ConditionStatus::Unknown.to_string())
}

/// The header and rows of the table `eddy get` prints.
fn table_rows(kind: Kind, body: Value) -> anyhow::Result<Vec<Vec<String>>> {
    let mut rows: Vec<Vec<String>> = Vec::new();
    let text = |value: &Option<String>| value.clone().unwrap_or_default();
    match kind {
        Kind::Functions => {
            rows.push(
                [
                    "NAMESPACE",
                    "NAME",
                    "RUNTIME",
                    "BUILT",
                    "RUNNING",
                    "REPLICAS",
                    "URL",
                ]
                .map(String::from)
                .to_vec(),
            );
            let functions: OneOrList<Function> = serde_json::from_value(body)
                .context("the API answered something else than functions")?;
            for function in functions.into_items() {
                let status = function.status.unwrap_or_default();
                rows.push(vec![
                    text(&function.metadata.namespace),
                    text(&function.metadata.name),
                    function.spec.runtime.as_str().to_owned(),
                    condition(&status.conditions, ConditionType::BuildReady),
                    condition(&status.conditions, ConditionType::Running),
                    status.replicas.to_string(),
                    text(&status.url),
                ]);
            }
        }
        Kind::Instances => {
            rows.push(
                ["NAME", "PHASE", "PID", "PORT", "IN-FLIGHT", "LABELS"]
                    .map(String::from)
                    .to_vec(),
            );
            for item in body["items"].as_array().into_iter().flatten() {
                let labels: Vec<String> = item["metadata"]["labels"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(key, value)| format!("{key}={}", value.as_str().unwrap_or_default()))
                    .collect();
                rows.push(vec![
                    item["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    item["status"]["phase"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    item["status"]["pid"].to_string(),
                    item["status"]["port"].to_string(),
                    item["status"]["inFlight"].to_string(),
                    labels.join(","),
                ]);
            }
        }
        Kind::Secrets | Kind::Configmaps => {
            let (header, data_field): (&[&str], &[&str]) = if kind == Kind::Secrets {
                (&["NAMESPACE", "NAME", "TYPE", "DATA"], &["dataKeys"])
            } else {
                (&["NAMESPACE", "NAME", "DATA"], &["data", "binaryData"])
            };
            rows.push(header.iter().map(|h| (*h).to_owned()).collect());
            let items = match body.get("items").and_then(Value::as_array) {
                Some(items) => items.clone(),
                None => vec![body],
            };
            for item in items {
                let mut row = vec![
                    item["metadata"]["namespace"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    item["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                ];
                if kind == Kind::Secrets {
                    row.push(item["type"].as_str().unwrap_or("Opaque").to_owned());
                }
                let count: usize = data_field
                    .iter()
                    .filter_map(|field| item[*field].as_object())
                    .map(serde_json::Map::len)
                    .sum();
                row.push(count.to_string());
                rows.push(row);
            }
        }
        Kind::Apirules => {
            rows.push(
                ["NAMESPACE", "NAME", "STATUS", "HOSTS", "DESCRIPTION"]
                    .map(String::from)
                    .to_vec(),
            );
            let rules: OneOrList<APIRule> = serde_json::from_value(body)
                .context("the API answered something else than APIRules")?;
            for rule in rules.into_items() {
                let status = rule.status.unwrap_or_default();
                rows.push(vec![
                    text(&rule.metadata.namespace),
                    text(&rule.metadata.name),
                    status.state,
                    rule.spec.hosts.join(","),
                    status.description.unwrap_or_default(),
                ]);
            }
        }
        Kind::Istios => {
            rows.push(
                ["NAMESPACE", "NAME", "STATUS", "AUTHORIZERS", "DESCRIPTION"]
                    .map(String::from)
                    .to_vec(),
            );
            let istios: OneOrList<eddy_model::istio::Istio> = serde_json::from_value(body)
                .context("the API answered something else than Istio resources")?;
            for istio in istios.into_items() {
                let status = istio.status.unwrap_or_default();
                let names: Vec<&str> = istio
                    .spec
                    .config
                    .authorizers
                    .iter()
                    .map(|a| a.name.as_str())
                    .collect();
                rows.push(vec![
                    text(&istio.metadata.namespace),
                    text(&istio.metadata.name),
                    status.state,
                    names.join(","),
                    status.description.unwrap_or_default(),
                ]);
            }
        }
        Kind::Ratelimits => {
            rows.push(
                ["NAMESPACE", "NAME", "STATUS", "SELECTOR", "DESCRIPTION"]
                    .map(String::from)
                    .to_vec(),
            );
            let rate_limits: OneOrList<eddy_model::ratelimit::RateLimit> =
                serde_json::from_value(body)
                    .context("the API answered something else than RateLimits")?;
            for rate_limit in rate_limits.into_items() {
                let status = rate_limit.status.unwrap_or_default();
                let selector: Vec<String> = rate_limit
                    .spec
                    .selector_labels
                    .iter()
                    .map(|(name, value)| format!("{name}={value}"))
                    .collect();
                rows.push(vec![
                    text(&rate_limit.metadata.namespace),
                    text(&rate_limit.metadata.name),
                    status.state,
                    selector.join(","),
                    status.description.unwrap_or_default(),
                ]);
            }
        }
        Kind::Subscriptions => {
            rows.push(
                ["NAMESPACE", "NAME", "READY", "SINK", "TYPES"]
                    .map(String::from)
                    .to_vec(),
            );
            let subscriptions: OneOrList<Subscription> = serde_json::from_value(body)
                .context("the API answered something else than subscriptions")?;
            for subscription in subscriptions.into_items() {
                let status = subscription.status.unwrap_or_default();
                rows.push(vec![
                    text(&subscription.metadata.namespace),
                    text(&subscription.metadata.name),
                    condition(&status.conditions, ConditionType::Ready),
                    subscription.spec.sink.clone(),
                    subscription.spec.types.join(","),
                ]);
            }
        }
    }
    Ok(rows)
}

/// The table `eddy get` prints, from what the API answered (one resource or a list).
pub fn table(kind: Kind, body: Value) -> anyhow::Result<String> {
    Ok(format_rows(&table_rows(kind, body)?))
}

/// Left-aligned columns separated by three spaces.
pub fn format_rows(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    rows.iter().map(|row| aligned(row, &widths)).collect()
}

/// `eddy delete KIND NAME` or `eddy delete -f FILE`.
pub async fn delete(
    api: &ApiArgs,
    kind: Option<Kind>,
    name: Option<&str>,
    file: Option<&PathBuf>,
) -> anyhow::Result<()> {
    let mut targets = Vec::new();
    match (kind, name, file) {
        (_, _, Some(file)) => {
            for manifest in read_manifests(file)? {
                targets.push(identify(&manifest, &api.namespace)?);
            }
        }
        (Some(kind), Some(name), None) => {
            targets.push((kind, api.namespace.clone(), name.to_owned()))
        }
        _ => bail!("say what to delete: `eddy delete functions NAME` or `eddy delete -f FILE`"),
    }
    let http = api.http()?;
    for (kind, namespace, name) in targets {
        let url = resource_url(&api.server, &namespace, kind, Some(&name));
        let response = http
            .delete(&url)
            .send()
            .await
            .with_context(|| format!("cannot reach {url}"))?;
        let label = kind.label(&name);
        if response.status().is_success() {
            println!("{label} deleted");
        } else {
            bail!("{label}: {}", refusal(response).await);
        }
    }
    Ok(())
}

/// The Kubernetes objects the controller would create for each Function in `path`, as YAML.
/// The commit a Git source's reference names now, as the controller would resolve it (a
/// repository that needs credentials from a Secret cannot be rendered without the cluster).
async fn resolve_offline(
    repository: &eddy_model::resources::GitRepositorySource,
) -> anyhow::Result<String> {
    if let Some(auth) = &repository.auth {
        anyhow::bail!(
            "spec.source.gitRepository.auth: the repository needs the credentials in Secret {}, \
             which only the controller in the cluster reads; render a copy without auth to see the objects",
            auth.secret_name
        );
    }
    let scratch = tempfile::tempdir()?;
    let config = eddy_controller::git::GitConfig {
        dir: scratch.path().to_owned(),
        timeout: eddy_controller::kubernetes::GIT_TIMEOUT,
    };
    eddy_controller::git::resolve(&config, &repository.url, &repository.reference, None)
        .await
        .map_err(|failure| anyhow::anyhow!("spec.source.gitRepository: {}", failure.message))
}

/// Functions are validated first, as the API server would; other kinds are skipped.
pub async fn render(
    path: &Path,
    kubernetes: &eddy_controller::KubernetesArgs,
) -> anyhow::Result<String> {
    let config = kubernetes.render_config();
    let mut out = String::new();
    let mut functions = 0;
    for manifest in read_manifests(path)? {
        if manifest.get("kind").and_then(Value::as_str) != Some("Function") {
            continue;
        }
        let function: eddy_model::resources::Function =
            serde_json::from_value(manifest).map_err(|error| {
                anyhow::anyhow!("{}: not a valid Function: {error}", path.display())
            })?;
        let function = eddy_controller::kubernetes::render::as_if_stored(function);
        let errors = eddy_model::resources::validate_function(&function);
        if !errors.is_empty() {
            anyhow::bail!(
                "Function {} is invalid: {}",
                function.metadata.name.as_deref().unwrap_or_default(),
                eddy_model::resources::describe_errors(&errors)
            );
        }
        let commit = match &function.spec.source.git_repository {
            None => None,
            Some(repository) => Some(resolve_offline(repository).await?),
        };
        out.push_str(
            &eddy_controller::kubernetes::render_at(&function, &config, commit.as_deref())?
                .to_yaml()?,
        );
        functions += 1;
    }
    if functions == 0 {
        anyhow::bail!("{} holds no Function", path.display());
    }
    Ok(out)
}

/// `eddy convert -f FILE|DIR`: the eddy-native form of every manifest, as YAML documents.
pub fn convert(path: &Path) -> anyhow::Result<String> {
    let manifests = read_manifests(path)?;
    if manifests.is_empty() {
        bail!("no manifests in {}", path.display());
    }
    let mut out = String::new();
    for manifest in manifests {
        let converted = eddy_model::kyma::to_native(manifest).map_err(|errors| {
            anyhow::anyhow!(
                "{}: {}",
                path.display(),
                eddy_model::resources::describe_errors(&errors)
            )
        })?;
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&converted)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_twice_in_one_mapping_is_refused_with_its_line() {
        let twice = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\nmetadata:\n  name: b\n";
        let error = format!("{:#}", check_structure(twice, "t").unwrap_err());
        assert!(error.contains("line 4"), "{error}");
        assert!(error.contains("\"metadata\" appears twice"), "{error}");
        // Quoted or plain, the same key.
        assert!(check_structure("a: 1\n'a': 2\n", "t").is_err());
        assert!(check_structure("{x: 1, \"x\": 2}", "t").is_err());
        // The same key in sibling mappings, a value equal to a key, several documents: fine.
        for fine in [
            "- a: 1\n- a: 2\n",
            "a: a\nb: {a: b}\n",
            "a: 1\n---\na: 2\n",
            "data:\n  script: |\n    x = {a: 1, a: 2}\n",
        ] {
            check_structure(fine, "t").unwrap_or_else(|error| panic!("{fine:?}: {error}"));
        }
    }

    #[test]
    fn deep_nesting_is_refused_however_it_hides() {
        let deep = |prefix: &str| {
            format!(
                "{prefix}a: {}{}\n",
                "[".repeat(100_000),
                "]".repeat(100_000)
            )
        };
        // Plain, and behind the scalars that made a scan of the text think the rest was quoted
        // (`'\\'` is a whole single-quoted scalar; `don't` a plain one).
        for prefix in ["", "x: '\\'\n", "y: don't\n", "z: \"\\\\\"\n"] {
            let started = std::time::Instant::now();
            let error = format!("{:#}", check_structure(&deep(prefix), "t").unwrap_err());
            assert!(
                error.contains("nested deeper than 64"),
                "{prefix:?}: {error}"
            );
            assert!(
                started.elapsed() < std::time::Duration::from_secs(2),
                "{prefix:?}"
            );
        }
        // Brackets inside quoted text, comments and block scalars are text.
        let text = format!(
            "a: '{0}'\nb: \"{0}\"\n# {0}\nc: |\n  {0}\n",
            "[".repeat(500)
        );
        check_structure(&text, "t").unwrap();
        // Block nesting counts too.
        let mut block = String::new();
        for depth in 0..70 {
            block.push_str(&format!("{}k{depth}:\n", "  ".repeat(depth)));
        }
        assert!(check_structure(&block, "t").is_err());
    }
}
