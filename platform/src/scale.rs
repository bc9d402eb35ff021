//! Scale from zero on Kubernetes: what the controller, the gateway and the dispatcher agree on.
//!
//! A Function whose `scaleConfig` lets it have no replica (`minReplicas: 0` below `maxReplicas`)
//! gets no HPA. Its Deployment carries [`SCALE_TO_ZERO_LABEL`] and [`MAX_REPLICAS_ANNOTATION`],
//! leaves `replicas` to whoever sets it through the scale subresource, and:
//! - the gateway sets it to one for a call, and while calls come renews the Function's calls
//!   Lease ([`calls_lease_name`], labelled [`CALLS_LABEL`]), which is all it may write besides
//!   the scale;
//! - the dispatcher sets it to one for an event, raises it with its Subscriptions' pending
//!   events, and sets it back to zero once nothing has come for the idle window.
//!
//! A Function with `minReplicas` of one or more that is annotated [`SCALE_ON_ANNOTATION`]`:
//! backlog` gets no HPA either: the dispatcher sets its replicas from its Subscriptions' pending
//! events in the same way, between [`MIN_REPLICAS_ANNOTATION`] and the maximum, never to zero.
//!
//! Every change is made only from the count it was decided on (a compare-and-set on the scale's
//! `resourceVersion`), so a wake-up never undoes a scale-out and a scale-in never undoes a
//! wake-up that came in between.

use k8s_openapi::{
    api::{apps::v1::Deployment, autoscaling::v1::Scale, coordination::v1::Lease},
    apimachinery::pkg::apis::meta::v1::MicroTime,
};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};

/// Label on every object of a Function (the Function's name): the Deployment's selector.
pub const FUNCTION_LABEL: &str = "eddy.dev/function";
/// Label on the Deployment of a Function that scales to zero (value `"true"`).
pub const SCALE_TO_ZERO_LABEL: &str = "eddy.dev/scale-to-zero";
/// Label on the Deployment of every Function whose replicas eddy sets (value
/// [`SCALED_BY_EDDY`]): those that scale to zero, and those that follow their backlog
/// ([`SCALE_ON_ANNOTATION`]). The dispatcher watches the Deployments it labels.
pub const SCALED_BY_LABEL: &str = "eddy.dev/scaled-by";
/// The value of [`SCALED_BY_LABEL`].
pub const SCALED_BY_EDDY: &str = "eddy";
/// Annotation on those Deployments: the most replicas the dispatcher may set.
pub const MAX_REPLICAS_ANNOTATION: &str = "eddy.dev/max-replicas";
/// Annotation on those Deployments: the fewest replicas the dispatcher may set (none: 0).
pub const MIN_REPLICAS_ANNOTATION: &str = "eddy.dev/min-replicas";
pub use eddy_model::resources::{SCALE_ON_ANNOTATION, SCALE_ON_BACKLOG, SCALE_ON_CPU};
/// Label on a Function's calls Lease: the Function's name. The Lease's `renewTime` is when the
/// gateway last forwarded a call to it.
pub const CALLS_LABEL: &str = "eddy.dev/calls-of";

/// The name of the calls Lease of `function`.
pub fn calls_lease_name(function: &str) -> String {
    format!("eddy-calls-{function}")
}

/// How many times a compare-and-set is tried again after another writer got in first.
const CONFLICT_RETRIES: usize = 5;

/// Sets the replicas of Deployment `namespace/name` to `to`, if its current count passes
/// `when`. Returns the count it had when changed, `None` when `when` said no.
pub async fn scale_deployment_if(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    when: impl Fn(i32) -> bool,
    to: i32,
) -> Result<Option<i32>, kube::Error> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let mut tries = 0;
    loop {
        let mut scale: Scale = api.get_scale(name).await?;
        let current = scale
            .spec
            .as_ref()
            .and_then(|spec| spec.replicas)
            .unwrap_or(0);
        if !when(current) || current == to {
            return Ok(None);
        }
        scale.spec.get_or_insert_with(Default::default).replicas = Some(to);
        match api
            .replace_scale(name, &PostParams::default(), &scale)
            .await
        {
            Ok(_) => return Ok(Some(current)),
            // Someone scaled it in between: decide again on what is there now.
            Err(kube::Error::Api(status)) if status.code == 409 && tries < CONFLICT_RETRIES => {
                tries += 1;
            }
            Err(error) => return Err(error),
        }
    }
}

/// Renews the calls Lease of Function `namespace/function` (created the first time): a call
/// was forwarded to it now.
pub async fn renew_calls_lease(
    client: &kube::Client,
    namespace: &str,
    function: &str,
) -> Result<(), kube::Error> {
    let api: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let name = calls_lease_name(function);
    let lease = serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "labels": {CALLS_LABEL: function}},
        "spec": {"holderIdentity": "eddy-gateway", "renewTime": MicroTime(k8s_openapi::jiff::Timestamp::now())},
    });
    api.patch(
        &name,
        &PatchParams::apply("eddy-gateway").force(),
        &Patch::Apply(&lease),
    )
    .await?;
    Ok(())
}

/// The seconds since the Unix epoch now (0 for a clock before it).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

/// When a calls Lease was last renewed (Unix seconds).
pub fn last_call(lease: &Lease) -> Option<u64> {
    let renewed = lease.spec.as_ref()?.renew_time.as_ref()?;
    u64::try_from(renewed.0.as_second()).ok()
}
