//! Optional bearer-token authentication (publishers on the event-bus, clients of the controller
//! API and the dispatcher's admin API).
//!
//! Tokens are kept only as SHA-256 digests and a presented token is hashed before the lookup, so
//! neither memory dumps nor timing reveal a token.

use std::{collections::HashSet, path::Path};

use axum::response::IntoResponse as _;
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The accepted tokens.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    digests: HashSet<[u8; 32]>,
}

impl Tokens {
    /// Tokens from a list and an optional file (one per line; blank lines and `#` comments
    /// ignored). `None` when there are none: authentication is off.
    pub fn load(listed: &[String], file: Option<&Path>) -> Result<Option<Self>> {
        let mut tokens = Self::default();
        for token in listed {
            tokens.add(token);
        }
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| Error::TokenFile {
                path: path.to_path_buf(),
                source,
            })?;
            for line in token_lines(&text) {
                tokens.add(line);
            }
        }
        Ok((!tokens.digests.is_empty()).then_some(tokens))
    }

    /// Tokens given by their SHA-256 digests.
    pub fn from_digests(digests: impl IntoIterator<Item = [u8; 32]>) -> Self {
        Self {
            digests: digests.into_iter().collect(),
        }
    }

    /// The digest form a Function's `access.tokenDigests` takes: `sha256:<hex>`.
    pub fn digest_text(token: &str) -> String {
        Sha256::digest(token.trim().as_bytes()).iter().fold(
            String::from("sha256:"),
            |mut out, byte| {
                out.push_str(&format!("{byte:02x}"));
                out
            },
        )
    }

    fn add(&mut self, token: &str) {
        let token = token.trim();
        if !token.is_empty() {
            self.digests.insert(Sha256::digest(token.as_bytes()).into());
        }
    }

    /// Whether `Authorization: Bearer <token>` carries an accepted token.
    pub fn allows(&self, headers: &http::HeaderMap) -> bool {
        bearer_token(headers).is_some_and(|token| self.allows_token(token))
    }

    /// Whether `token` is accepted.
    pub fn allows_token(&self, token: &str) -> bool {
        self.digests
            .contains(&<[u8; 32]>::from(Sha256::digest(token.as_bytes())))
    }
}

/// The `Authorization: Bearer <token>` value to send `token` with (marked sensitive, so it is
/// kept out of debug output); `None` when the token is not printable ASCII.
pub fn bearer_header(token: &str) -> Option<http::HeaderValue> {
    let mut value = http::HeaderValue::from_str(&format!("Bearer {token}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// The token of an `Authorization: Bearer <token>` header.
pub fn bearer_token(headers: &http::HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// Flags that turn bearer-token authentication on for a service's API.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ApiTokenArgs {
    /// Bearer tokens the API accepts (comma-separated); none: no authentication.
    #[arg(
        long = "api-tokens",
        env = "EDDY_API_TOKENS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_tokens: Vec<String>,
    /// A file of accepted API tokens, one per line.
    #[arg(long = "api-token-file", env = "EDDY_API_TOKEN_FILE")]
    pub api_token_file: Option<std::path::PathBuf>,
}

impl ApiTokenArgs {
    /// The tokens, or `None` when authentication is off.
    pub fn load(&self) -> Result<Option<Tokens>> {
        Tokens::load(&self.api_tokens, self.api_token_file.as_deref())
    }

    /// A token to call the API with: the first listed, else the file's first, or `None` when
    /// authentication is off.
    pub fn client_token(&self) -> Result<Option<String>> {
        if let Some(token) = self
            .api_tokens
            .iter()
            .map(|t| t.trim())
            .find(|t| !t.is_empty())
        {
            return Ok(Some(token.to_owned()));
        }
        let Some(path) = self.api_token_file.as_deref() else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path).map_err(|source| Error::TokenFile {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(token_lines(&text).next().map(str::to_owned))
    }
}

/// The tokens of a token file: one per line, blank lines and `#` comments left out.
fn token_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
}

/// Requires an accepted bearer token on every route of `router` but the probes (`/healthz`,
/// `/readyz`); `None` leaves the router open. A GET of one of `query_token_paths` may carry the
/// token as `?token=` instead (the dashboard's live tail: a browser's `EventSource` cannot set
/// headers); nowhere else, so tokens stay out of other URLs, their logs and histories.
pub fn protect<S: Clone + Send + Sync + 'static>(
    router: axum::Router<S>,
    tokens: Option<Tokens>,
    query_token_paths: &'static [&'static str],
) -> axum::Router<S> {
    match tokens {
        Some(tokens) => router.layer(axum::middleware::from_fn_with_state(
            std::sync::Arc::new(Protection {
                tokens,
                query_token_paths,
            }),
            require_token,
        )),
        None => router,
    }
}

struct Protection {
    tokens: Tokens,
    query_token_paths: &'static [&'static str],
}

async fn require_token(
    axum::extract::State(protection): axum::extract::State<std::sync::Arc<Protection>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let path = request.uri().path();
    let open = path == "/healthz" || path == "/readyz";
    let tokens = &protection.tokens;
    if open
        || tokens.allows(request.headers())
        || (protection.query_token_paths.contains(&path) && query_token_allowed(tokens, &request))
    {
        return next.run(request).await;
    }
    crate::errors::ErrorResponse::new(
        http::StatusCode::UNAUTHORIZED,
        serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 401,
            "reason": "Unauthorized", "message": "a valid bearer token is required (Authorization: Bearer <token>)",
        }),
    )
    .into_response()
}

fn query_token_allowed(tokens: &Tokens, request: &axum::extract::Request) -> bool {
    if request.method() != http::Method::GET {
        return false;
    }
    let Some(query) = request.uri().query() else {
        return false;
    };
    url::form_urlencoded::parse(query.as_bytes())
        .filter(|(key, _)| key == "token")
        .any(|(_, token)| tokens.allows_token(&token))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(value: &str) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, value.parse().unwrap());
        headers
    }

    #[test]
    fn accepts_only_listed_tokens() {
        let tokens = Tokens::load(&["s3cret".to_owned(), " ".to_owned()], None)
            .unwrap()
            .unwrap();
        assert!(tokens.allows(&bearer("Bearer s3cret")));
        assert!(tokens.allows(&bearer("bearer s3cret")));
        assert!(!tokens.allows(&bearer("Bearer other")));
        assert!(!tokens.allows(&bearer("Basic s3cret")));
        assert!(!tokens.allows(&http::HeaderMap::new()));
    }

    #[test]
    fn no_tokens_means_no_auth() {
        assert!(Tokens::load(&[], None).unwrap().is_none());
        assert!(Tokens::load(&[String::new()], None).unwrap().is_none());
    }

    #[test]
    fn reads_token_files() {
        let dir = std::env::temp_dir().join(format!("eddy-tokens-{}", std::process::id()));
        std::fs::write(&dir, "# publishers\n\nfirst\n  second  \n").unwrap();
        let tokens = Tokens::load(&[], Some(&dir)).unwrap().unwrap();
        std::fs::remove_file(&dir).unwrap();
        assert!(tokens.allows(&bearer("Bearer first")));
        assert!(tokens.allows(&bearer("Bearer second")));
        assert!(!tokens.allows(&bearer("Bearer # publishers")));
        assert!(Tokens::load(&[], Some(Path::new("/nonexistent/eddy"))).is_err());
    }
}
