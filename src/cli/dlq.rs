//! `eddy dlq list|redrive` and `eddy replay`: dead letters and replays through the dispatcher.

use anyhow::{Context as _, bail};
use eddy_model::admin::{DeadLetterList, Redriven, ReplayRequest, ReplayStarted};
use serde::de::DeserializeOwned;

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

/// The dispatcher's answer as `T`, or its error message.
async fn check<T: DeserializeOwned>(response: reqwest::Response) -> anyhow::Result<T> {
    let status = response.status();
    if !status.is_success() {
        let body: serde_json::Value = response.json().await.unwrap_or_default();
        bail!(
            "{}",
            body["error"].as_str().map_or_else(
                || format!("the dispatcher answered {status}"),
                str::to_owned
            )
        );
    }
    response
        .json()
        .await
        .context("the dispatcher's answer is not what eddy expects")
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
    let body: DeadLetterList = check(response).await?;
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&body)?),
        Output::Yaml => print!("{}", serde_yaml_ng::to_string(&body)?),
        Output::Table => {
            if body.items.is_empty() {
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
            for item in body.items {
                rows.push(vec![
                    item.sequence.to_string(),
                    item.subscription,
                    item.reason,
                    item.status.map(|s| s.to_string()).unwrap_or_default(),
                    item.attempts.to_string(),
                    item.ty,
                    item.source,
                    item.id,
                    item.time,
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
    let body: Redriven = check(response).await?;
    println!(
        "redrive of {namespace}/{subscription}: {} delivered, {} failed (still in dead letters)",
        body.delivered, body.failed
    );
    if body.failed > 0 {
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
        (Some(since), None) => ReplayRequest {
            since: Some(since.to_owned()),
            from_seq: None,
        },
        (None, Some(sequence)) => ReplayRequest {
            since: None,
            from_seq: Some(sequence),
        },
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
    let body: ReplayStarted = check(response).await?;
    println!(
        "replaying {} stored event(s) to {namespace}/{subscription}",
        body.events
    );
    Ok(())
}
