//! The Helm chart in `charts/eddy` against the code: the committed CRDs are the generated ones,
//! every value a template reads is defined, and the chart depends on the NATS chart. (The
//! ClusterRoles are derived from recorded API requests: `kubernetes::tests` in this crate for the
//! controller, `tests/dispatch_kubernetes.rs` for the dispatcher. Helm itself is not run here;
//! the templates are read as text. `tests/chart_rendered.rs` renders them with Helm.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{collections::BTreeSet, path::PathBuf};

use serde_yaml_ng::Value;

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

#[test]
fn committed_kyma_crds_are_the_generated_ones() {
    let generated = eddy_model::kyma::crds_yaml().unwrap();
    let committed = read("files/kyma-crds.yaml");
    assert!(
        committed == generated,
        "charts/eddy/files/kyma-crds.yaml is out of date; regenerate it with\n  cargo run -q -- crds --kyma > charts/eddy/files/kyma-crds.yaml"
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
    let values: Value = serde_yaml_ng::from_str(&read("values.yaml")).unwrap();
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

/// NATS is the chart's own (no dependency to fetch, so the chart installs offline): three
/// clustered servers by default, with the event streams at R3.
#[test]
fn the_chart_runs_its_own_nats_without_a_dependency() {
    let chart_yaml: Value = serde_yaml_ng::from_str(&read("Chart.yaml")).unwrap();
    assert!(chart_yaml.get("dependencies").is_none(), "{chart_yaml:?}");
    let values: Value = serde_yaml_ng::from_str(&read("values.yaml")).unwrap();
    assert_eq!(values["nats"]["enabled"], true);
    assert_eq!(values["nats"]["replicas"], 3);
    assert_eq!(values["eventBus"]["stream"]["replicas"], 3);
}
