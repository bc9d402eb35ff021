//! One leader and its watches: a Lease namespace that comes late, a standby taking over, and watches that relist after 410 Gone.

use super::*;

/// A controller started before the namespace of its Lease exists (a new user's order of steps)
/// says why it cannot join the election, keeps trying, and leads and reconciles once the
/// namespace and the chart's Lease Role are there: no restart.
#[tokio::test]
async fn a_controller_started_before_its_lease_namespace_leads_once_it_exists() {
    use k8s_openapi::api::{
        core::v1::Namespace,
        rbac::v1::{Role, RoleBinding},
    };
    let _serial = serial().await;
    let cluster = Cluster::new("late-lease").await;
    let lease_namespace = format!("{}-lease", cluster.namespace);
    let controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_LEASE_NAMESPACE", &lease_namespace),
            ],
        )
        .await;
    eventually(
        "the controller to say why it cannot join",
        Duration::from_secs(30),
        || async {
            let log = controller.log();
            log.contains("cannot join the lease election") && log.contains(&lease_namespace)
        },
    )
    .await
    .unwrap_or_else(|error| panic!("{error}:\n{}", controller.log()));

    // The namespace, and in it the chart's Lease Role and its binding, as the chart makes them.
    let namespaces: Api<Namespace> = Api::all(cluster.admin.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": lease_namespace}})).unwrap(),
        )
        .await
        .unwrap();
    let roles: Api<Role> = Api::namespaced(cluster.admin.clone(), SYSTEM);
    let bindings: Api<RoleBinding> = Api::namespaced(cluster.admin.clone(), SYSTEM);
    let lease_role = roles
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|role| {
            role.rules.iter().flatten().any(|rule| {
                rule.resources
                    .iter()
                    .flatten()
                    .any(|resource| resource == "leases")
            })
        })
        .expect("the chart's Lease Role");
    let role_name = lease_role.metadata.name.clone().unwrap();
    let binding = bindings
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|binding| binding.role_ref.name == role_name)
        .expect("the chart's Lease RoleBinding");
    let copy = |metadata: &kube::core::ObjectMeta| kube::core::ObjectMeta {
        name: metadata.name.clone(),
        namespace: Some(lease_namespace.clone()),
        ..Default::default()
    };
    Api::<Role>::namespaced(cluster.admin.clone(), &lease_namespace)
        .create(
            &PostParams::default(),
            &Role {
                metadata: copy(&lease_role.metadata),
                rules: lease_role.rules.clone(),
            },
        )
        .await
        .unwrap();
    Api::<RoleBinding>::namespaced(cluster.admin.clone(), &lease_namespace)
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: copy(&binding.metadata),
                role_ref: binding.role_ref.clone(),
                subjects: binding.subjects.clone(),
            },
        )
        .await
        .unwrap();

    let leases: Api<Lease> = Api::namespaced(cluster.admin.clone(), &lease_namespace);
    let lease_name = format!("{RELEASE}-controller");
    eventually(
        "the controller to lead, unrestarted",
        Duration::from_secs(30),
        || async {
            leases.get(&lease_name).await.is_ok_and(|l| {
                l.spec.and_then(|s| s.holder_identity).as_deref() == Some(controller.name.as_str())
            })
        },
    )
    .await
    .unwrap_or_else(|error| panic!("{error}:\n{}", controller.log()));
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    functions
        .patch(
            "late",
            &PatchParams::apply("test"),
            &Patch::Apply(function("late", inline("module.exports = {main: () => 1}"))),
        )
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "late", Duration::from_secs(60))
        .await;
    drop(controller);
    let _ = namespaces
        .delete(&lease_namespace, &DeleteParams::default())
        .await;
    cluster.finish().await;
}

/// Two controllers: one leads; SIGKILL it and the other takes over within the lease duration;
/// only the leader wrote (the API server's audit log, by each replica's user agent; and
/// managedFields).
#[tokio::test]
async fn a_standby_controller_takes_over_within_the_lease_duration() {
    let _serial = serial().await;
    let cluster = Cluster::new("leader").await;
    let mut first = cluster.controller().await;
    let leases: Api<Lease> = Api::namespaced(cluster.admin.clone(), SYSTEM);
    let lease_name = format!("{RELEASE}-controller");
    eventually(
        "the first controller to lead",
        Duration::from_secs(30),
        || async {
            leases.get(&lease_name).await.is_ok_and(|l| {
                l.spec.and_then(|s| s.holder_identity).as_deref() == Some(first.name.as_str())
            })
        },
    )
    .await
    .unwrap();
    let second = cluster.controller().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let apply = PatchParams::apply("test");
    functions
        .patch(
            "led",
            &apply,
            &Patch::Apply(function("led", inline("module.exports = {main: () => 1}"))),
        )
        .await
        .unwrap();
    cluster
        .wait_running("eddy.dev/v1alpha1", "led", Duration::from_secs(60))
        .await;
    let killed_at = chrono::Utc::now();
    first.kill();
    let killed = Instant::now();
    functions
        .patch(
            "after",
            &apply,
            &Patch::Apply(function(
                "after",
                inline("module.exports = {main: () => 2}"),
            )),
        )
        .await
        .unwrap();
    eventually("the standby to lead", Duration::from_secs(10), || async {
        leases.get(&lease_name).await.is_ok_and(|l| {
            l.spec.and_then(|s| s.holder_identity).as_deref() == Some(second.name.as_str())
        })
    })
    .await
    .unwrap();
    let took_over = killed.elapsed();
    assert!(
        took_over <= Duration::from_secs(4) + Duration::from_secs(2),
        "took over after {took_over:?}, the lease is {LEASE_DURATION}"
    );
    cluster
        .wait_running("eddy.dev/v1alpha1", "after", Duration::from_secs(60))
        .await;
    // Only the leader wrote: the audit log tells the replicas apart by their user agents.
    // Until the first was killed, the standby made no write but its lease attempts; the
    // first's writes are there (so the check can see a write when there is one).
    let writes_by = |name: &str, before: chrono::DateTime<chrono::Utc>| -> Vec<String> {
        let agent = format!("eddy-controller/{name}");
        audit_events(cluster.plane)
            .iter()
            .filter(|event| received(event) >= cluster.started && received(event) < before)
            .filter(|event| event["userAgent"] == agent.as_str() && is_write(event))
            .filter(|event| event["objectRef"]["resource"] != "leases")
            .map(describe)
            .collect()
    };
    assert!(
        !writes_by(&first.name, killed_at).is_empty(),
        "the leader's writes are in the audit log"
    );
    let standby = writes_by(&second.name, killed_at);
    assert!(
        standby.is_empty(),
        "the standby wrote while it stood by:\n{}",
        standby.join("\n")
    );
    // Only the controller's field manager wrote the children.
    let deployments: Api<Deployment> = cluster.api();
    for name in ["led", "after"] {
        let deployment = deployments.get(name).await.unwrap();
        let managers: Vec<String> = deployment
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .filter(|f| f.operation.as_deref() == Some("Apply"))
            .filter_map(|f| f.manager.clone())
            .collect();
        assert_eq!(managers, ["eddy-controller"], "{name}");
    }
    eprintln!("the standby took over {took_over:?} after the leader's SIGKILL");
    drop(second);
    cluster.finish().await;
}

/// A watch whose resourceVersion is gone (etcd compacted, the API server's watch cache new)
/// gets 410 Gone; the controller, the dispatcher and the gateway list again and miss no change
/// made meanwhile (additions, a change, a deletion).
#[tokio::test]
async fn watches_relist_after_410_gone_and_miss_nothing() {
    let _serial = serial().await;
    let cluster = Cluster::new("gone").await;
    let ns = cluster.namespace.clone();
    // Without leader election, so that pausing it below cannot cost it the lead (a new leader
    // lists anyway, which would hide what this test is about).
    let controller = cluster
        .component(
            "controller",
            &[
                ("EDDY_API_ADDR", "127.0.0.1:0"),
                ("EDDY_LEADER_ELECTION", "false"),
            ],
        )
        .await;
    let events = Events::start(&cluster).await;
    let dispatcher = events.dispatcher(&cluster).await;
    let (gateway, url) = gateway(&cluster, &function_services().await).await;
    let sink = support::Sink::ok().await;
    let functions = cluster.dynamic("eddy.dev/v1alpha1", "Function");
    let subscriptions = cluster.dynamic("eddy.dev/v1alpha1", "Subscription");
    let apply = PatchParams::apply("test");
    functions
        .patch(
            "before",
            &apply,
            &Patch::Apply(with_access("before", json!({"mode": "public"}))),
        )
        .await
        .unwrap();
    for name in ["kept", "dropped"] {
        subscriptions
            .patch(
                name,
                &apply,
                &Patch::Apply(eddy_subscription(name, &sink.url, &["order.created.v1"])),
            )
            .await
            .unwrap();
    }
    cluster
        .wait_running("eddy.dev/v1alpha1", "before", Duration::from_secs(60))
        .await;
    eventually(
        "the consumers and the route",
        Duration::from_secs(30),
        || async {
            events.consumer(&ns, "kept").await.is_some()
                && events.consumer(&ns, "dropped").await.is_some()
                && call(&format!("{url}/{ns}/before/"), None).await.0 == 200
        },
    )
    .await
    .unwrap();

    // The three paused (SIGSTOP) see nothing of the changes; etcd is compacted past them and
    // the API server restarted, so their watches resume from a revision that is gone.
    let pids: Vec<String> = [&controller, &dispatcher, &gateway]
        .iter()
        .map(|component| component.child.id().to_string())
        .collect();
    for pid in &pids {
        run(Command::new("kill").args(["-STOP", pid])).unwrap();
    }
    let digest = eddy_platform::auth::Tokens::digest_text("secret");
    functions
        .patch(
            "before",
            &apply,
            &Patch::Apply(with_access(
                "before",
                json!({"mode": "token", "tokenDigests": [digest]}),
            )),
        )
        .await
        .unwrap();
    for index in 0..3 {
        let name = format!("during-{index}");
        functions
            .patch(
                &name,
                &apply,
                &Patch::Apply(with_access(&name, json!({"mode": "public"}))),
            )
            .await
            .unwrap();
    }
    subscriptions
        .patch(
            "added",
            &apply,
            &Patch::Apply(eddy_subscription("added", &sink.url, &["order.paid.v1"])),
        )
        .await
        .unwrap();
    subscriptions
        .delete("dropped", &DeleteParams::default())
        .await
        .unwrap();
    cluster.plane.compact_etcd().unwrap();
    cluster.plane.restart_api_server().unwrap();
    for pid in &pids {
        run(Command::new("kill").args(["-CONT", pid])).unwrap();
    }
    for index in 0..3 {
        cluster
            .wait_running(
                "eddy.dev/v1alpha1",
                &format!("during-{index}"),
                Duration::from_secs(90),
            )
            .await;
    }
    eventually(
        "the dispatcher and the gateway to catch up",
        Duration::from_secs(60),
        || async {
            events.consumer(&ns, "added").await.is_some()
                && events.consumer(&ns, "dropped").await.is_none()
                && events.consumer(&ns, "kept").await.is_some()
                && call(&format!("{url}/{ns}/before/"), None).await.0 == 401
                && call(&format!("{url}/{ns}/before/"), Some("secret")).await.0 == 200
                && call(&format!("{url}/{ns}/during-2/"), None).await.0 == 200
        },
    )
    .await
    .unwrap();
    drop((controller, dispatcher, gateway));
    cluster.finish().await;
}
