//! Function: its runtimes, source, access, env, resources, status, and its validation.

use super::{
    BTreeMap, Condition, CustomResource, Deserialize, Duration, ENV_NAME_MESSAGE, FieldError,
    GIT_URL_MESSAGE, IntOrString, JsonSchema, KubeSchema, Quantity, Serialize, is_config_key,
    is_dns1123_subdomain, is_env_name, is_qualified_name_part, presets, validate_metadata,
};

mod quantity;
mod runtime;
mod spec;
mod status;
mod validate;

pub use self::{quantity::*, runtime::*, spec::*, status::*, validate::*};

/// Annotation on a Function (eddy's or Kyma's) whose `minReplicas` is one or more: what its
/// replicas follow on Kubernetes. [`SCALE_ON_BACKLOG`]: its Subscriptions' backlog, set by the
/// dispatcher (no HPA); [`SCALE_ON_CPU`], the default: CPU, by an HPA.
pub const SCALE_ON_ANNOTATION: &str = "eddy.dev/scale-on";
/// [`SCALE_ON_ANNOTATION`]'s value for replicas that follow the backlog.
pub const SCALE_ON_BACKLOG: &str = "backlog";
/// [`SCALE_ON_ANNOTATION`]'s value for replicas that follow CPU (as without the annotation).
pub const SCALE_ON_CPU: &str = "cpu";

impl Function {
    /// The value of its [`SCALE_ON_ANNOTATION`], if it has one.
    pub fn scale_on(&self) -> Option<&str> {
        self.metadata
            .annotations
            .as_ref()?
            .get(SCALE_ON_ANNOTATION)
            .map(String::as_str)
    }
}
