//! Status conditions, written the same way by both backends (local and Kubernetes), with the
//! shared vocabulary of [`eddy_model::conditions`].

use eddy_model::{
    conditions::{ConditionType, Reason},
    resources::Condition,
};

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
        status: match ok {
            Some(true) => "True",
            Some(false) => "False",
            None => "Unknown",
        }
        .to_owned(),
        reason: reason.as_str().to_owned(),
        message: message.into(),
        last_transition_time: time,
    }
}
