//! Client verbs of the `eddy` command line.

pub mod dlq;
pub mod functions;
pub mod publish;
pub mod resources;

/// An HTTP client that sends `Authorization: Bearer <token>` with every request when a token is
/// given.
pub fn http_client(token: Option<&str>) -> anyhow::Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(token) = token {
        let value = eddy_platform::auth::bearer_header(token)
            .ok_or_else(|| anyhow::anyhow!("the token must be printable ASCII"))?;
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    Ok(reqwest::Client::builder()
        .default_headers(headers)
        .build()?)
}
