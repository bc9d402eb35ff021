//! The dispatcher: events delivered for Subscriptions of both groups.

use super::*;

/// A nats-server and the chart's event-bus in front of it, as processes.
/// (Fields drop in order: the event-bus stops before its nats-server.)
pub(crate) struct Events {
    bus: Component,
    nats: eddy_testing::NatsServer,
    bus_url: String,
    js: async_nats::jetstream::Context,
    http: reqwest::Client,
}

impl Events {
    pub(crate) async fn start(cluster: &Cluster) -> Self {
        let nats = eddy_testing::NatsServer::start().unwrap();
        let bus = cluster
            .component(
                "event-bus",
                &[
                    ("EDDY_NATS_URL", &nats.url()),
                    ("EDDY_BUS_ADDR", "127.0.0.1:0"),
                ],
            )
            .await;
        let bus_url = bus.url().await;
        let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
        Self {
            bus,
            nats,
            bus_url,
            js,
            http: reqwest::Client::new(),
        }
    }

    /// The chart's dispatcher against this nats-server.
    pub(crate) async fn dispatcher(&self, cluster: &Cluster) -> Component {
        cluster
            .component(
                "dispatcher",
                &[
                    ("EDDY_NATS_URL", &self.nats.url()),
                    ("EDDY_DISPATCHER_ADDR", "127.0.0.1:0"),
                ],
            )
            .await
    }

    pub(crate) async fn publish(&self, ty: &str, id: &str) {
        let response = self
            .http
            .post(format!("{}/publish", self.bus_url))
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", "shop")
            .header("ce-type", ty)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 204, "publish {id}: {}", self.bus.log());
    }

    /// The consumer of Subscription `namespace/name`, if there is one.
    pub(crate) async fn consumer(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<async_nats::jetstream::consumer::Info> {
        let stream = self
            .js
            .get_stream(eddy_platform::nats::EVENTS_STREAM)
            .await
            .ok()?;
        stream
            .consumer_info(eddy_model::resources::consumer_name(namespace, name))
            .await
            .ok()
    }

    /// Waits until Subscription `namespace/name`'s consumer has delivered all it matches.
    pub(crate) async fn settled(&self, namespace: &str, name: &str) {
        eventually(
            &format!("{name} to settle"),
            Duration::from_secs(30),
            || async {
                let Ok(stream) = self.js.get_stream(eddy_platform::nats::EVENTS_STREAM).await
                else {
                    return false;
                };
                eddy::bench::consumer_settled(
                    &stream,
                    &eddy_model::resources::consumer_name(namespace, name),
                )
                .await
                .unwrap_or(false)
            },
        )
        .await
        .unwrap();
    }
}

pub(crate) fn eddy_subscription(name: &str, sink: &str, types: &[&str]) -> Value {
    json!({
        "apiVersion": "eddy.dev/v1alpha1", "kind": "Subscription", "metadata": {"name": name},
        "spec": {"sink": sink, "source": "shop", "types": types},
    })
}

pub(crate) fn kyma_subscription(name: &str, sink: &str, types: &[&str]) -> Value {
    json!({
        "apiVersion": "eventing.kyma-project.io/v1alpha2", "kind": "Subscription",
        "metadata": {"name": name},
        "spec": {"sink": sink, "source": "shop", "types": types},
    })
}

/// The chart's dispatcher reads Subscriptions of both API groups from the API server (under its
/// ClusterRole), delivers each matching event to a sink it may reach, and follows updates and
/// deletions.
#[tokio::test]
async fn the_dispatcher_delivers_for_subscriptions_of_both_groups_and_follows_them() {
    let _serial = serial().await;
    let cluster = Cluster::new("dispatch").await;
    let events = Events::start(&cluster).await;
    let dispatcher = events.dispatcher(&cluster).await;
    let ns = cluster.namespace.clone();
    let (native, kyma) = (support::Sink::ok().await, support::Sink::ok().await);
    let eddy_api = cluster.dynamic("eddy.dev/v1alpha1", "Subscription");
    let kyma_api = cluster.dynamic("eventing.kyma-project.io/v1alpha2", "Subscription");
    let apply = PatchParams::apply("test");
    let created = ["order.created.v1"];
    eddy_api
        .patch(
            "on-order",
            &apply,
            &Patch::Apply(eddy_subscription("on-order", &native.url, &created)),
        )
        .await
        .unwrap();
    kyma_api
        .patch(
            "kyma-on-order",
            &apply,
            &Patch::Apply(kyma_subscription("kyma-on-order", &kyma.url, &created)),
        )
        .await
        .unwrap();
    for name in ["on-order", "kyma-on-order"] {
        eventually(
            &format!("the consumer of {name}"),
            Duration::from_secs(30),
            || async { events.consumer(&ns, name).await.is_some() },
        )
        .await
        .unwrap();
    }
    for index in 0..5 {
        events
            .publish("order.created.v1", &format!("c-{index}"))
            .await;
    }
    native.wait_for(5).await;
    kyma.wait_for(5).await;
    // Settled first: a duplicate delivered late is seen.
    events.settled(&ns, "on-order").await;
    events.settled(&ns, "kyma-on-order").await;
    let expected: Vec<String> = (0..5).map(|i| format!("c-{i}")).collect();
    for sink in [&native, &kyma] {
        let mut ids = sink.ids();
        ids.sort();
        assert_eq!(ids, expected);
    }

    // An update: the consumer's filter follows the object.
    eddy_api
        .patch(
            "on-order",
            &apply,
            &Patch::Apply(eddy_subscription(
                "on-order",
                &native.url,
                &["order.paid.v1"],
            )),
        )
        .await
        .unwrap();
    eventually(
        "the filter to follow the update",
        Duration::from_secs(30),
        || async {
            events.consumer(&ns, "on-order").await.is_some_and(|info| {
                info.config.filter_subjects == ["eddy.events.shop.order.paid.v1"]
                    || info.config.filter_subject == "eddy.events.shop.order.paid.v1"
            })
        },
    )
    .await
    .unwrap();
    events.publish("order.created.v1", "c-after").await;
    events.publish("order.paid.v1", "p-1").await;
    native.wait_for(6).await;
    kyma.wait_for(6).await;
    events.settled(&ns, "on-order").await;
    events.settled(&ns, "kyma-on-order").await;
    assert_eq!(
        native.ids()[5..],
        ["p-1".to_owned()],
        "only the new type after the update"
    );
    assert_eq!(kyma.ids()[5..], ["c-after".to_owned()]);

    // Deletions: the consumers go.
    eddy_api
        .delete("on-order", &DeleteParams::default())
        .await
        .unwrap();
    kyma_api
        .delete("kyma-on-order", &DeleteParams::default())
        .await
        .unwrap();
    for name in ["on-order", "kyma-on-order"] {
        eventually(
            &format!("the consumer of {name} to go"),
            Duration::from_secs(30),
            || async { events.consumer(&ns, name).await.is_none() },
        )
        .await
        .unwrap();
    }
    cluster.assert_no_rbac_refusal();
    drop(dispatcher);
    cluster.finish().await;
}
