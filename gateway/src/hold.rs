//! What calls waiting for their Function to start (scale from zero) may hold: a number of
//! calls and the bytes of their bodies, over every Function, and of each a share per Function.
//! A held call keeps its whole body in the gateway's memory until a pod or instance takes it,
//! up to the wake timeout; without a bound in bytes, two hundred 2 MB calls to a Function
//! that never starts held 500 MB. Past the budget a call is answered 503 with `Retry-After` at
//! once; past its Function's share likewise, so one Function's burst never leaves another's
//! wake-up without room.

use std::{collections::HashMap, sync::Arc};

use eddy_platform::{errors::ErrorResponse, flags::HoldArgs};
use http::StatusCode;
use parking_lot::Mutex;

use crate::FunctionKey;

/// The held calls' budget, shared by every call of one gateway.
#[derive(Debug)]
pub struct HoldBudget {
    limits: Limits,
    held: Mutex<Usage>,
}

/// The bounds, over every Function and per Function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limits {
    calls: usize,
    bytes: u64,
    calls_per_function: usize,
    bytes_per_function: u64,
}

/// What is held now, in all and by Function.
#[derive(Debug, Default)]
struct Usage {
    calls: usize,
    bytes: u64,
    by_function: HashMap<FunctionKey, (usize, u64)>,
}

/// One held call's part of the budget, given back when dropped (the call reached its Function,
/// or gave up).
#[derive(Debug)]
pub struct Held {
    budget: Arc<HoldBudget>,
    key: FunctionKey,
    bytes: u64,
}

impl HoldBudget {
    /// The budget `args` sets.
    pub fn new(args: &HoldArgs) -> Self {
        let share = args.held_share_percent.clamp(1, 100);
        let calls = args.max_held_calls.max(1);
        let bytes = args.max_held_bytes.as_u64().max(1);
        Self {
            limits: Limits {
                calls,
                bytes,
                // At least one call and one byte per Function, whatever the share.
                calls_per_function: (calls * usize::from(share) / 100).max(1),
                bytes_per_function: (bytes * u64::from(share) / 100).max(1),
            },
            held: Mutex::default(),
        }
    }

    /// Holds a call to `key` with a body of `bytes` (more may be added as it arrives, see
    /// [`Held::grow`]), or says why it cannot be held (503 with `Retry-After`, naming the
    /// bound).
    pub fn hold(self: &Arc<Self>, key: &FunctionKey, bytes: u64) -> Result<Held, ErrorResponse> {
        self.take(key, 1, bytes)?;
        Ok(Held {
            budget: self.clone(),
            key: key.clone(),
            bytes,
        })
    }

    /// Takes `calls` and `bytes` more for `key`, when every bound has room for them.
    fn take(&self, key: &FunctionKey, calls: usize, bytes: u64) -> Result<(), ErrorResponse> {
        let limits = self.limits;
        let mut held = self.held.lock();
        let (function_calls, function_bytes) =
            held.by_function.get(key).copied().unwrap_or_default();
        let refusal = if held.calls + calls > limits.calls {
            Some(Refusal::Calls)
        } else if held.bytes + bytes > limits.bytes {
            Some(Refusal::Bytes)
        } else if function_calls + calls > limits.calls_per_function
            || function_bytes + bytes > limits.bytes_per_function
        {
            Some(Refusal::Share)
        } else {
            None
        };
        if let Some(refusal) = refusal {
            drop(held);
            let (namespace, function) = key;
            return Err(ErrorResponse::message(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "function {namespace}/{function} has no ready pod, and {}",
                    refusal.why()
                ),
            ));
        }
        held.calls += calls;
        held.bytes += bytes;
        let entry = held.by_function.entry(key.clone()).or_default();
        entry.0 += calls;
        entry.1 += bytes;
        Ok(())
    }

    /// Calls and bytes held now, over every Function.
    #[cfg(test)]
    fn usage(&self) -> (usize, u64) {
        let held = self.held.lock();
        (held.calls, held.bytes)
    }
}

/// Which bound a call met.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    Calls,
    Bytes,
    Share,
}

impl Refusal {
    fn why(self) -> &'static str {
        match self {
            Self::Calls => "too many calls are waiting for Functions to start (--max-held-calls)",
            Self::Bytes => {
                "the calls waiting for Functions to start hold as many bytes as allowed \
                 (--max-held-bytes)"
            }
            Self::Share => {
                "its calls waiting for it to start hold its whole share of the budget \
                 (--held-share-per-function)"
            }
        }
    }
}

impl Held {
    /// Adds `bytes` more of the call's body as they arrive, or says why they do not fit: the
    /// call is then refused before the rest of its body is read.
    pub fn grow(&mut self, bytes: u64) -> Result<(), ErrorResponse> {
        self.budget.take(&self.key, 0, bytes)?;
        self.bytes += bytes;
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.budget.held.lock();
        held.calls = held.calls.saturating_sub(1);
        held.bytes = held.bytes.saturating_sub(self.bytes);
        if let Some(entry) = held.by_function.get_mut(&self.key) {
            entry.0 = entry.0.saturating_sub(1);
            entry.1 = entry.1.saturating_sub(self.bytes);
            if entry.0 == 0 {
                held.by_function.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn budget(calls: usize, bytes: u64, share: u8) -> Arc<HoldBudget> {
        Arc::new(HoldBudget::new(&HoldArgs {
            max_held_calls: calls,
            max_held_bytes: bytesize::ByteSize::b(bytes),
            held_share_percent: share,
        }))
    }

    fn said(refused: &ErrorResponse) -> String {
        format!("{refused:?}")
    }

    fn key(name: &str) -> FunctionKey {
        ("default".to_owned(), name.to_owned())
    }

    #[test]
    fn bytes_are_bounded_over_every_function_and_per_function() {
        let budget = budget(100, 10_000, 50);
        // One Function takes its half of the bytes, then is refused.
        let a1 = budget.hold(&key("a"), 3_000).unwrap();
        let a2 = budget.hold(&key("a"), 2_000).unwrap();
        let refused = budget.hold(&key("a"), 1).unwrap_err();
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            said(&refused).contains("--held-share-per-function"),
            "{refused:?}"
        );
        // Another Function still has room: its wake-up is not starved.
        let b1 = budget.hold(&key("b"), 5_000).unwrap();
        // Over every Function, the budget is spent.
        let refused = budget.hold(&key("c"), 1).unwrap_err();
        assert!(said(&refused).contains("--max-held-bytes"), "{refused:?}");
        assert_eq!(budget.usage(), (3, 10_000));
        // Given back when the calls go on.
        drop((a1, b1));
        assert_eq!(budget.usage(), (1, 2_000));
        assert!(budget.hold(&key("c"), 4_000).is_ok());
        drop(a2);
        assert_eq!(budget.usage(), (0, 0));
        assert!(budget.held.lock().by_function.is_empty());
    }

    #[test]
    fn a_body_is_charged_as_it_arrives() {
        let budget = budget(100, 10_000, 50);
        let mut held = budget.hold(&key("a"), 0).unwrap();
        held.grow(3_000).unwrap();
        held.grow(2_000).unwrap();
        let refused = held.grow(1).unwrap_err();
        assert!(
            said(&refused).contains("--held-share-per-function"),
            "{refused:?}"
        );
        // What did not fit was not taken.
        assert_eq!(budget.usage(), (1, 5_000));
        drop(held);
        assert_eq!(budget.usage(), (0, 0));
    }

    #[test]
    fn calls_are_bounded_over_every_function_and_per_function() {
        let budget = budget(4, 1 << 30, 50);
        let a: Vec<_> = (0..2).map(|_| budget.hold(&key("a"), 0).unwrap()).collect();
        let refused = budget.hold(&key("a"), 0).unwrap_err();
        assert!(
            said(&refused).contains("--held-share-per-function"),
            "{refused:?}"
        );
        let b: Vec<_> = (0..2).map(|_| budget.hold(&key("b"), 0).unwrap()).collect();
        let refused = budget.hold(&key("c"), 0).unwrap_err();
        assert!(said(&refused).contains("--max-held-calls"), "{refused:?}");
        drop((a, b));
        assert_eq!(budget.usage(), (0, 0));
    }

    #[test]
    fn a_whole_share_lets_one_function_take_everything_and_a_tiny_one_still_a_call() {
        let whole = budget(10, 1_000, 100);
        let all = whole.hold(&key("a"), 1_000).unwrap();
        assert!(whole.hold(&key("b"), 1).is_err());
        drop(all);
        let tiny = budget(3, 100, 1);
        assert!(tiny.hold(&key("a"), 0).is_ok());
    }
}
