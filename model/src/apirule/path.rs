//! Kyma's path templates (`/*`, `{*}`, `{**}`) and which rule a request falls under.

/// Why a rule's path is not a path template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// It does not start with `/`.
    #[error("must start with /")]
    Relative,
    /// A segment holds `*`, `{` or `}` outside the operators.
    #[error(
        "segment {0:?}: '*', '{{' and '}}' only in the operators {{*}} and {{**}}, or as a last /*"
    )]
    Operator(String),
    /// A segment holds a character paths do not.
    #[error("segment {segment:?}: {character:?} is not allowed in a path")]
    Character {
        /// The segment.
        segment: String,
        /// The character.
        character: char,
    },
    /// `{**}` (or `/*`) is followed by another operator.
    #[error("{{**}} (or /*) must be the last operator")]
    AnyNotLast,
}

/// One piece of a path template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Segment {
    /// This text exactly.
    Literal(String),
    /// `{*}`: any one segment (also an empty one).
    One,
    /// `{**}` or a trailing `/*`: any number of segments, none included.
    Any,
}

/// A rule's path (Kyma's templates): exact, with `{*}` and `{**}`, or `/*` for every path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate {
    segments: Vec<Segment>,
}

impl PathTemplate {
    /// Reads `path`, or says what is wrong with it. `v2alpha1`'s `/.*` means every path.
    pub fn parse(path: &str) -> Result<Self, PathError> {
        if path == "/*" || path == "/.*" {
            return Ok(Self {
                segments: vec![Segment::Any],
            });
        }
        let Some(rest) = path.strip_prefix('/') else {
            return Err(PathError::Relative);
        };
        let parts: Vec<&str> = rest.split('/').collect();
        let mut segments = Vec::with_capacity(parts.len());
        for (index, part) in parts.iter().enumerate() {
            let last = index + 1 == parts.len();
            let segment = match *part {
                "{*}" => Segment::One,
                "{**}" => Segment::Any,
                "*" if last => Segment::Any,
                text => {
                    if text.contains(['*', '{', '}']) {
                        return Err(PathError::Operator(text.to_owned()));
                    }
                    if let Some(bad) = text.chars().find(|c| !is_path_char(*c)) {
                        return Err(PathError::Character {
                            segment: text.to_owned(),
                            character: bad,
                        });
                    }
                    Segment::Literal(text.to_owned())
                }
            };
            segments.push(segment);
        }
        // Only literals may follow `{**}`: it must be the last operator.
        if segments
            .iter()
            .skip_while(|s| **s != Segment::Any)
            .skip(1)
            .any(|s| !matches!(s, Segment::Literal(_)))
        {
            return Err(PathError::AnyNotLast);
        }
        Ok(Self { segments })
    }

    /// Whether the request path `path` (without its query) matches.
    pub fn matches(&self, path: &str) -> bool {
        let path = path.strip_prefix('/').unwrap_or(path);
        let parts: Vec<&str> = path.split('/').collect();
        matches_from(&self.segments, &parts)
    }
}

/// Whether `parts` matches `segments`: `{**}` takes zero or more parts (only literals follow
/// it, so trying each split is linear in practice).
pub(super) fn matches_from(segments: &[Segment], parts: &[&str]) -> bool {
    match segments.split_first() {
        None => parts.is_empty(),
        Some((Segment::Literal(text), rest)) => parts
            .split_first()
            .is_some_and(|(part, after)| part == text && matches_from(rest, after)),
        Some((Segment::One, rest)) => parts
            .split_first()
            .is_some_and(|(_, after)| matches_from(rest, after)),
        Some((Segment::Any, rest)) => {
            (0..=parts.len()).any(|taken| matches_from(rest, &parts[taken..]))
        }
    }
}

/// RFC 3986 path characters (Kyma's pattern), `%` for escapes.
pub(super) fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-._~!$&'()+,;=:@%".contains(c)
}

/// Which rule (by index) a `method` call to `path` falls under, as Kyma (Istio) decides: the
/// first rule that lists the method and matches the path, unless an earlier rule sharing any
/// method with it matches the path too (then the path is excluded from the later rule). `None`:
/// no rule allows the call. Pure.
pub fn select_rule(
    templates: &[(PathTemplate, Vec<String>)],
    method: &str,
    path: &str,
) -> Option<usize> {
    let shares = |a: &[String], b: &[String]| a.iter().any(|m| b.contains(m));
    templates
        .iter()
        .enumerate()
        .position(|(index, (template, methods))| {
            methods.iter().any(|m| m == method)
                && template.matches(path)
                && !templates[..index].iter().any(|(earlier, earlier_methods)| {
                    shares(earlier_methods, methods) && earlier.matches(path)
                })
        })
}
