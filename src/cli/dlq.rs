//! `eddy dlq list|redrive` and `eddy replay`: dead letters and replays through the dispatcher.

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use super::resources::{Output, format_rows};

/// Where the dispatcher's admin API is.
#[derive(Debug, Clone, clap::Args)]
pub struct DispatcherArgs {
    /// The dispatcher's admin API.
    #[arg(
        long = "dispatcher",
        env = "EDDY_DISPATCHER_URL",
        default_value = "http://127.0.0.1:8083",
        global = true
    )]
    pub dispatcher: String,
    /// Bearer token for the dispatcher's admin API, when it requires one.
    #[arg(
        long = "token",
        env = "EDDY_TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub token: Option<String>,
}

fn base(args: &DispatcherArgs) -> &str {
    args.dispatcher.trim_end_matches('/')
}

async fn check(response: reqwest::Response) -> anyhow::Result<Value> {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        bail!(
            "{}",
            body["error"].as_str().map_or_else(
                || format!("the dispatcher answered {status}"),
                str::to_owned
            )
        );
    }
    Ok(body)
}

/// `eddy dlq list [SUB]`.
pub async fn list(
    args: &DispatcherArgs,
    namespace: &str,
    subscription: Option<&str>,
    output: Output,
) -> anyhow::Result<()> {
    let mut url = format!("{}/dead-letters", base(args));
    if let Some(subscription) = subscription {
        url.push_str(&format!("?subscription={namespace}/{subscription}"));
    }
    let response = super::http_client(args.token.as_deref())?
        .get(&url)
        .send()
        .await
        .with_context(|| format!("cannot reach the dispatcher at {}", args.dispatcher))?;
    let body = check(response).await?;
    let items = body["items"].as_array().cloned().unwrap_or_default();
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&body)?),
        Output::Yaml => print!("{}", serde_yaml_ng::to_string(&body)?),
        Output::Table => {
            if items.is_empty() {
                println!("no dead letters");
                return Ok(());
            }
            let mut rows = vec![
                [
                    "SEQ",
                    "SUBSCRIPTION",
                    "REASON",
                    "STATUS",
                    "ATTEMPTS",
                    "TYPE",
                    "SOURCE",
                    "ID",
                    "TIME",
                ]
                .map(String::from)
                .to_vec(),
            ];
            for item in items {
                let text = |key: &str| match &item[key] {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    other => other.to_string(),
                };
                rows.push(vec![
                    text("sequence"),
                    text("subscription"),
                    text("reason"),
                    text("status"),
                    text("attempts"),
                    text("type"),
                    text("source"),
                    text("id"),
                    text("time"),
                ]);
            }
            print!("{}", format_rows(&rows));
        }
    }
    Ok(())
}

/// `eddy dlq redrive SUB`.
pub async fn redrive(
    args: &DispatcherArgs,
    namespace: &str,
    subscription: &str,
) -> anyhow::Result<()> {
    let url = format!(
        "{}/subscriptions/{namespace}/{subscription}/redrive",
        base(args)
    );
    let response = super::http_client(args.token.as_deref())?
        .post(&url)
        .send()
        .await
        .with_context(|| format!("cannot reach the dispatcher at {}", args.dispatcher))?;
    let body = check(response).await?;
    println!(
        "redrive of {namespace}/{subscription}: {} delivered, {} failed (still in dead letters)",
        body["delivered"], body["failed"]
    );
    if body["failed"].as_u64().unwrap_or(0) > 0 {
        bail!("some dead letters could not be delivered");
    }
    Ok(())
}

/// `eddy replay SUB --since D | --from-seq N`.
pub async fn replay(
    args: &DispatcherArgs,
    namespace: &str,
    subscription: &str,
    since: Option<&str>,
    from_seq: Option<u64>,
) -> anyhow::Result<()> {
    let request = match (since, from_seq) {
        (Some(since), None) => json!({ "since": since }),
        (None, Some(sequence)) => json!({ "fromSeq": sequence }),
        _ => bail!("give exactly one of --since DURATION or --from-seq N"),
    };
    let url = format!(
        "{}/subscriptions/{namespace}/{subscription}/replay",
        base(args)
    );
    let response = super::http_client(args.token.as_deref())?
        .post(&url)
        .json(&request)
        .send()
        .await
        .with_context(|| format!("cannot reach the dispatcher at {}", args.dispatcher))?;
    let body = check(response).await?;
    println!(
        "replaying {} stored event(s) to {namespace}/{subscription}",
        body["events"]
    );
    Ok(())
}
