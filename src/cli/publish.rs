//! `eddy publish`: send one event to the event-bus in binary mode and print its id.

use anyhow::{Context as _, bail};

/// Flags of `eddy publish`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// CloudEvents type, e.g. `order.created.v1`.
    #[arg(long = "type", env = "EDDY_EVENT_TYPE")]
    pub ty: String,
    /// CloudEvents source, e.g. `shop`.
    #[arg(long, env = "EDDY_EVENT_SOURCE")]
    pub source: String,
    /// The data; sent as is with the given content type.
    #[arg(long, default_value = "{}")]
    pub data: String,
    /// Content type of the data.
    #[arg(long = "content-type", default_value = "application/json")]
    pub content_type: String,
    /// Event id; a fresh UUID when not given.
    #[arg(long)]
    pub id: Option<String>,
    /// Event time (RFC 3339); now when not given.
    #[arg(long)]
    pub time: Option<String>,
    /// Extension attributes as NAME=VALUE (repeatable).
    #[arg(long = "extension", short = 'e', value_parser = parse_extension)]
    pub extensions: Vec<(String, String)>,
    /// The event-bus URL.
    #[arg(
        long = "bus",
        env = "EDDY_BUS_URL",
        default_value = "http://127.0.0.1:8081"
    )]
    pub bus: String,
    /// Bearer token, when the event-bus requires one.
    #[arg(long, env = "EDDY_BUS_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

fn parse_extension(text: &str) -> anyhow::Result<(String, String)> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| anyhow::anyhow!("`{text}` is not NAME=VALUE"))?;
    Ok((name.to_owned(), value.to_owned()))
}

/// Publishes and prints the event id.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let Args {
        ty,
        source,
        data,
        content_type,
        id,
        time,
        extensions,
        bus,
        token,
    } = args;
    if content_type.contains("json") {
        serde_json::from_str::<serde_json::Value>(&data)
            .with_context(|| format!("--data is not valid JSON for content type {content_type}"))?;
    }
    let id = id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let time = time
        .unwrap_or_else(|| chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
    let url = format!("{}/publish", bus.trim_end_matches('/'));
    let mut request = reqwest::Client::new()
        .post(&url)
        .header("ce-specversion", "1.0")
        .header("ce-id", &id)
        .header("ce-source", &source)
        .header("ce-type", &ty)
        .header("ce-time", &time)
        .header("content-type", &content_type);
    for (name, value) in &extensions {
        request = request.header(format!("ce-{name}"), value);
    }
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request
        .body(data)
        .send()
        .await
        .with_context(|| format!("cannot reach the event-bus at {url}"))?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        bail!("the event-bus refused the event ({status}): {body}");
    }
    println!("{id}");
    Ok(())
}
