//! Optional bearer-token authentication for publishers.
//!
//! Tokens are kept only as SHA-256 digests and a presented token is hashed before the lookup, so
//! neither memory dumps nor timing reveal a token.

use std::{collections::HashSet, path::Path};

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The accepted publisher tokens.
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
            for line in text.lines() {
                let line = line.trim();
                if !line.is_empty() && !line.starts_with('#') {
                    tokens.add(line);
                }
            }
        }
        Ok((!tokens.digests.is_empty()).then_some(tokens))
    }

    fn add(&mut self, token: &str) {
        let token = token.trim();
        if !token.is_empty() {
            self.digests.insert(Sha256::digest(token.as_bytes()).into());
        }
    }

    /// Whether `Authorization: Bearer <token>` carries an accepted token.
    pub fn allows(&self, headers: &http::HeaderMap) -> bool {
        headers
            .get(http::header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                let (scheme, token) = value.split_once(' ')?;
                scheme
                    .eq_ignore_ascii_case("bearer")
                    .then_some(token.trim())
            })
            .is_some_and(|token| {
                self.digests
                    .contains(&<[u8; 32]>::from(Sha256::digest(token.as_bytes())))
            })
    }
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
