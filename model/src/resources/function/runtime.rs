//! The runtimes a Function runs on, and the environment each gives its handler.

use super::{Deserialize, FUNC_TIMEOUT_ENV, JsonSchema, Serialize};

/// Function runtimes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Runtime {
    /// Node.js 20, `handler.js` exporting `main(event, context, sendResponse)`.
    #[serde(rename = "nodejs20")]
    Nodejs20,
    /// Node.js 22, the same contract as nodejs20.
    #[serde(rename = "nodejs22")]
    Nodejs22,
    /// Node.js 24, the same contract as nodejs20.
    #[serde(rename = "nodejs24")]
    Nodejs24,
    /// Node.js 26, Kyma's new handler API: `handler.js` exporting `main(req, res)` with
    /// Express's request and response, and the `sdk` module.
    #[serde(rename = "nodejs26")]
    Nodejs26,
    /// Python 3.11, `handler.py` defining `main(event, context)`.
    #[serde(rename = "python311")]
    Python311,
    /// Python 3.12, the same contract as python311.
    #[serde(rename = "python312")]
    Python312,
    /// Python 3.14, Kyma's new handler API: `handler.py` defining `main()`, which reads Flask's
    /// `flask.request`, served by gevent; the `sdk` module.
    #[serde(rename = "python314")]
    Python314,
}

/// How a runtime calls the function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerApi {
    /// Kyma's first API: `main(event, context)`.
    EventContext,
    /// Kyma's new runtime API (nodejs26, python314): the framework's own request (Express's
    /// `req` and `res`, Flask's `flask.request`) and the `sdk` module.
    Request,
}

impl Runtime {
    /// Every runtime, in the order manifests and help texts list them.
    pub const ALL: [Runtime; 7] = [
        Self::Nodejs20,
        Self::Nodejs22,
        Self::Nodejs24,
        Self::Nodejs26,
        Self::Python311,
        Self::Python312,
        Self::Python314,
    ];

    /// Every runtime's name, as help texts and errors list them.
    pub const NAMES: &'static str =
        "nodejs20, nodejs22, nodejs24, nodejs26, python311, python312 or python314";

    /// The name used in manifests and paths.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nodejs20 => "nodejs20",
            Self::Nodejs22 => "nodejs22",
            Self::Nodejs24 => "nodejs24",
            Self::Nodejs26 => "nodejs26",
            Self::Python311 => "python311",
            Self::Python312 => "python312",
            Self::Python314 => "python314",
        }
    }

    /// How the runtime calls the function.
    pub fn handler_api(self) -> HandlerApi {
        match self {
            Self::Nodejs26 | Self::Python314 => HandlerApi::Request,
            _ => HandlerApi::EventContext,
        }
    }

    /// Kyma's deprecation of the runtime, when Kyma's schedule has deprecated it: said at apply
    /// and in the Function's status; the Function still runs.
    pub fn deprecation(self) -> Option<String> {
        match self {
            // Node.js 20 reached its end of life in April 2026, Node.js 22 in November 2026.
            Self::Nodejs20 | Self::Nodejs22 => Some(format!(
                "runtime {} is deprecated and will be removed in the future (Kyma's deprecation \
                 schedule); move to nodejs26",
                self.as_str()
            )),
            _ => None,
        }
    }

    /// The Node.js major version a Node.js runtime runs on (`None` for Python).
    pub fn node_major(self) -> Option<u32> {
        match self {
            Self::Nodejs20 => Some(20),
            Self::Nodejs22 => Some(22),
            Self::Nodejs24 => Some(24),
            Self::Nodejs26 => Some(26),
            Self::Python311 | Self::Python312 | Self::Python314 => None,
        }
    }

    /// The Python minor version (3.x) a Python runtime runs on (`None` for Node.js).
    pub fn python_minor(self) -> Option<u32> {
        match self {
            Self::Python311 => Some(11),
            Self::Python312 => Some(12),
            Self::Python314 => Some(14),
            _ => None,
        }
    }
}

/// Environment variables the platform sets; users may not set them.
pub const RESERVED_ENV: [&str; 9] = [
    "FUNC_NAME",
    "FUNC_NAMESPACE",
    "SERVICE_NAMESPACE",
    "FUNC_RUNTIME",
    "FUNC_HANDLER",
    "MOD_NAME",
    "FUNC_PORT",
    "EDDY_INSTANCE_SECRET",
    "EDDY_PUBLISHER_TOKEN",
];

/// Where a function's runtime publishes events. The platform sets it; a Function may set its
/// own (Kyma's tests point it at a publisher mock), and then that is what its runtime uses.
pub const PUBLISHER_PROXY_ADDRESS: &str = "PUBLISHER_PROXY_ADDRESS";

/// The environment every function instance gets from the platform (Kyma's runtime contract),
/// the same in both backends: its name and namespace, runtime, handler, port, timeout and where
/// it publishes events; for Kyma's new runtime API (nodejs26, python314) also the names its
/// servers read (`HANDLER_MOD_NAME`, `HANDLER_FUNC_NAME`, `SERVER_PORT`). Pure.
pub fn runtime_env(
    name: &str,
    namespace: &str,
    runtime: Runtime,
    port: impl ToString,
    timeout_seconds: impl ToString,
    publisher_url: &str,
) -> Vec<(&'static str, String)> {
    let port = port.to_string();
    let mut env = vec![
        ("FUNC_NAME", name.to_owned()),
        ("FUNC_NAMESPACE", namespace.to_owned()),
        ("SERVICE_NAMESPACE", namespace.to_owned()),
        ("FUNC_RUNTIME", runtime.as_str().to_owned()),
        ("FUNC_HANDLER", "main".to_owned()),
        ("MOD_NAME", "handler".to_owned()),
        ("FUNC_PORT", port.clone()),
        (FUNC_TIMEOUT_ENV, timeout_seconds.to_string()),
        (PUBLISHER_PROXY_ADDRESS, publisher_url.to_owned()),
    ];
    if runtime.handler_api() == HandlerApi::Request {
        env.extend([
            ("HANDLER_MOD_NAME", "handler".to_owned()),
            ("HANDLER_FUNC_NAME", "main".to_owned()),
            ("SERVER_PORT", port),
        ]);
    }
    env
}
