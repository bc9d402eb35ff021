//! Status conditions, written the same way by both backends (local and Kubernetes), with the
//! shared vocabulary of [`eddy_model::conditions`].

use eddy_model::{
    conditions::{ConditionType, Reason},
    resources::{Condition, ConditionStatus},
};

/// Why a build (or fetching its source) failed: the BuildReady reason and message, in either
/// backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct BuildFailure {
    /// CamelCase reason for the BuildReady condition.
    pub reason: Reason,
    /// What happened, with the tail of the build log.
    pub message: String,
}

impl BuildFailure {
    /// A failure to read or write a build's files.
    pub fn io(what: &str, path: &std::path::Path, error: &std::io::Error) -> Self {
        Self {
            reason: Reason::BuildFailed,
            message: format!("cannot {what} {}: {error}", path.display()),
        }
    }
}

/// The last `lines` lines of `text`: what a condition's message keeps of a build's log.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Now, as conditions write times (RFC 3339, seconds, `Z`).
pub fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// A condition as of now: `ok` is `True`, `False` or (`None`) `Unknown`.
pub fn condition(
    type_: ConditionType,
    ok: Option<bool>,
    reason: Reason,
    message: impl Into<String>,
) -> Condition {
    condition_at(type_, ok, reason, message, now())
}

/// A condition as of `time` (for pure code that is given the time).
pub fn condition_at(
    type_: ConditionType,
    ok: Option<bool>,
    reason: Reason,
    message: impl Into<String>,
    time: String,
) -> Condition {
    Condition {
        type_: type_.as_str().to_owned(),
        status: ok.map_or(ConditionStatus::Unknown, ConditionStatus::from_bool),
        reason: reason.as_str().to_owned(),
        message: message.into(),
        last_transition_time: time,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tails_keep_the_last_lines() {
        assert_eq!(tail("1\n2\n3\n4", 2), "3\n4");
        assert_eq!(tail("1", 5), "1");
    }
}
