//! A Subscription's reconcile: its sink checked and its status written (the dispatcher
//! consumes it).

use super::{
    Action, Api, Arc, Context, Duration, Error, RESYNC, Readiness, Result, Service, Subscription,
    SubscriptionStatus, describe_errors, desired_status, key_of, now, parse_function_sink,
    validate_subscription, write_status,
};
use kube::ResourceExt as _;

/// Validates a Subscription (its sink must be a Service in its namespace, or an allowed URL)
/// and reports the subjects its types resolve to.
pub async fn reconcile_subscription(
    subscription: Arc<Subscription>,
    context: Arc<Context>,
) -> Result<Action> {
    let key = key_of(subscription.as_ref());
    let namespace = subscription
        .namespace()
        .ok_or(Error::Incomplete("namespace"))?;
    let errors = validate_subscription(&subscription, &context.sinks);
    let (readiness, message, action) = if !errors.is_empty() {
        let message = describe_errors(&errors);
        (Readiness::Invalid, message, Action::await_change())
    } else if let Some(sink) = parse_function_sink(&subscription.spec.sink) {
        let services: Api<Service> = Api::namespaced(context.client.clone(), &namespace);
        if services.get_opt(&sink.function).await?.is_some() {
            (
                Readiness::Ready,
                format!("delivering to Service {}", sink.function),
                Action::requeue(RESYNC),
            )
        } else {
            (
                Readiness::SinkNotFound,
                format!("no Service {} in namespace {namespace}", sink.function),
                Action::requeue(Duration::from_secs(15)),
            )
        }
    } else {
        (
            Readiness::Ready,
            "delivering to an allowed URL".to_owned(),
            Action::requeue(RESYNC),
        )
    };
    let status: SubscriptionStatus = desired_status(
        &subscription,
        subscription.status.as_ref(),
        readiness,
        message,
        &now(),
    );
    write_status(
        &context.client,
        subscription.as_ref(),
        subscription.status.as_ref(),
        &status,
    )
    .await?;
    context.record_success(&key);
    Ok(action)
}
