//! The Helm chart in `charts/eddy` against the code: the committed CRDs are the generated ones,
//! every value a template reads is defined, and the controller's RBAC grants what the
//! reconciler does and no more. (Helm itself cannot run here; the templates are read as text.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{collections::BTreeSet, path::PathBuf};

use serde_yaml::Value;

fn chart() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/eddy")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(chart().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn committed_crds_are_the_generated_ones() {
    let generated = eddy_model::resources::crds_yaml().unwrap();
    let committed = read("crds/eddy.dev.yaml");
    assert!(
        committed == generated,
        "charts/eddy/crds/eddy.dev.yaml is out of date; regenerate it with\n  cargo run -q -- crds > charts/eddy/crds/eddy.dev.yaml"
    );
}

/// `.Values.a.b` paths in a template text.
fn value_paths(text: &str) -> BTreeSet<String> {
    let mut paths = BTreeSet::new();
    for (index, _) in text.match_indices(".Values.") {
        let rest = &text[index + ".Values.".len()..];
        let path: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '_')
            .collect();
        paths.insert(path.trim_end_matches('.').to_owned());
    }
    paths
}

#[test]
fn every_value_a_template_reads_is_defined() {
    let values: Value = serde_yaml::from_str(&read("values.yaml")).unwrap();
    let mut checked = 0;
    for entry in std::fs::read_dir(chart().join("templates")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for value_path in value_paths(&text) {
            let mut node = &values;
            for key in value_path.split('.') {
                node = node.get(key).unwrap_or_else(|| {
                    panic!(
                        "{} reads .Values.{value_path}, which values.yaml does not define",
                        path.display()
                    )
                });
            }
            checked += 1;
        }
    }
    assert!(checked > 30, "templates read their values ({checked})");
}

#[test]
fn the_chart_depends_on_the_nats_chart() {
    let chart_yaml: Value = serde_yaml::from_str(&read("Chart.yaml")).unwrap();
    let dependency = &chart_yaml["dependencies"][0];
    assert_eq!(dependency["name"], "nats");
    assert_eq!(dependency["condition"], "nats.enabled");
    let values: Value = serde_yaml::from_str(&read("values.yaml")).unwrap();
    assert_eq!(values["nats"]["config"]["cluster"]["replicas"], 3);
    assert_eq!(values["eventBus"]["stream"]["replicas"], 3);
}

type Rules = Vec<(String, String, BTreeSet<String>)>;

/// The ClusterRole's rules in a template, with template lines dropped.
fn cluster_role_rules(template: &str) -> Rules {
    let document = template
        .split("\n---")
        .find(|doc| doc.contains("kind: ClusterRole\n"))
        .expect("a ClusterRole");
    let plain: String = document
        .lines()
        .filter(|line| !line.contains("{{"))
        .collect::<Vec<_>>()
        .join("\n");
    let role: Value = serde_yaml::from_str(&plain).unwrap();
    let mut rules = Vec::new();
    for rule in role["rules"].as_sequence().unwrap() {
        let list = |key: &str| -> Vec<String> {
            rule[key]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect()
        };
        let verbs: BTreeSet<String> = list("verbs").into_iter().collect();
        for group in list("apiGroups") {
            for resource in list("resources") {
                rules.push((group.clone(), resource, verbs.clone()));
            }
        }
    }
    rules
}

fn granted(rules: &Rules) -> BTreeSet<String> {
    rules
        .iter()
        .flat_map(|(group, resource, verbs)| {
            verbs
                .iter()
                .map(move |verb| format!("{group}/{resource}:{verb}"))
        })
        .collect()
}

#[test]
fn the_controller_gets_exactly_what_the_reconciler_uses() {
    let rules = cluster_role_rules(&read("templates/controller.yaml"));
    let needed: BTreeSet<String> = [
        // The controllers list and watch these (reconciles get them from the watch).
        "eddy.dev/functions:list",
        "eddy.dev/functions:watch",
        "eddy.dev/subscriptions:list",
        "eddy.dev/subscriptions:watch",
        "eddy.dev/functions/status:patch",
        "eddy.dev/subscriptions/status:patch",
        // Owner references with blockOwnerDeletion.
        "eddy.dev/functions/finalizers:update",
        // Server-side apply is a patch that may create.
        "/configmaps:list",
        "/configmaps:patch",
        "/configmaps:create",
        "/configmaps:delete",
        "batch/jobs:get",
        "batch/jobs:list",
        "batch/jobs:watch",
        "batch/jobs:patch",
        "batch/jobs:create",
        "batch/jobs:delete",
        "/pods:list",
        "apps/deployments:list",
        "apps/deployments:watch",
        "apps/deployments:patch",
        "apps/deployments:create",
        "/services:get",
        "/services:patch",
        "/services:create",
        "autoscaling/horizontalpodautoscalers:patch",
        "autoscaling/horizontalpodautoscalers:create",
        "autoscaling/horizontalpodautoscalers:delete",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(granted(&rules), needed);
    assert!(
        rules
            .iter()
            .all(|(g, r, v)| g != "*" && r != "*" && !v.contains("*"))
    );
}

#[test]
fn the_dispatcher_only_reads_subscriptions() {
    let rules = cluster_role_rules(&read("templates/dispatcher.yaml"));
    let expected: BTreeSet<String> = [
        "eddy.dev/subscriptions:list",
        "eddy.dev/subscriptions:watch",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(granted(&rules), expected);
}
