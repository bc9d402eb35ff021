//! Kubernetes RBAC permissions written `group/resource[/subresource]:verb` (the core group is
//! empty: `/configmaps:get`): the one a request to the API server needs, and the ones a chart's
//! ClusterRole grants. Tests compare the two, so a new API call fails until the chart allows it.

use std::collections::BTreeSet;

/// What a request needs. A server-side apply (`PATCH` with `fieldManager`) may create the
/// object, so it needs `create` besides `patch`.
pub fn needed_by(method: &str, path_and_query: &str) -> BTreeSet<String> {
    let (path, query) = path_and_query
        .split_once('?')
        .unwrap_or((path_and_query, ""));
    let parameter = |name: &str| {
        query
            .split('&')
            .any(|pair| pair == name || pair.starts_with(&format!("{name}=")))
    };
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (group, mut rest) = match segments.as_slice() {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => panic!("not a Kubernetes API path: {path_and_query}"),
    };
    if let ["namespaces", _namespace, inner @ ..] = rest
        && !inner.is_empty()
    {
        rest = inner;
    }
    let (resource, name, subresource) = match rest {
        [resource] => (*resource, None, None),
        [resource, name] => (*resource, Some(*name), None),
        [resource, name, subresource] => (*resource, Some(*name), Some(*subresource)),
        _ => panic!("not a Kubernetes API path: {path_and_query}"),
    };
    let resource = match subresource {
        Some(subresource) => format!("{resource}/{subresource}"),
        None => resource.to_owned(),
    };
    let verbs: &[&str] = match (method, name) {
        ("GET", Some(_)) => &["get"],
        ("GET", None) if parameter("watch") => &["watch"],
        ("GET", None) => &["list"],
        ("POST", _) => &["create"],
        ("PUT", _) => &["update"],
        ("PATCH", _) if parameter("fieldManager") && subresource.is_none() => &["patch", "create"],
        ("PATCH", _) => &["patch"],
        ("DELETE", Some(_)) => &["delete"],
        ("DELETE", None) => &["deletecollection"],
        _ => panic!("no RBAC verb for {method} {path_and_query}"),
    };
    verbs
        .iter()
        .map(|verb| format!("{group}/{resource}:{verb}"))
        .collect()
}

/// The chart's `template` (a file under `templates/`) as Helm renders it with the chart's
/// defaults and `sets` (external NATS, from a copy without the NATS subchart): what a cluster
/// would be given, conditional rules decided as they would be.
pub fn rendered(template: &str, sets: &[&str]) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let dir = tempfile::tempdir()?;
    let chart = crate::control_plane::chart_copy(dir.path())?;
    let mut helm = std::process::Command::new(crate::control_plane::tool("bin/helm")?);
    helm.args(["template", "eddy"])
        .arg(&chart)
        .args(["--show-only", &format!("templates/{template}")])
        .args([
            "--set",
            "nats.enabled=false",
            "--set",
            "externalNats.url=nats://nats:4222",
        ]);
    for set in sets {
        helm.args(["--set", set]);
    }
    crate::control_plane::run(&mut helm).with_context(|| format!("rendering {template}"))
}

/// What the ClusterRole in rendered YAML ([`rendered`]) grants. Panics on a wildcard: the
/// chart names every group, resource and verb.
pub fn granted_by_cluster_role(rendered: &str) -> BTreeSet<String> {
    granted_by_role(rendered, "ClusterRole")
}

/// What the role of `kind` (`ClusterRole` or `Role`) in rendered YAML grants. Panics on a
/// wildcard, or on a template line left in (render the chart first).
pub fn granted_by_role(rendered: &str, kind: &str) -> BTreeSet<String> {
    let top_level = format!("kind: {kind}");
    let document = rendered
        .split("\n---")
        .find(|doc| doc.lines().any(|line| line == top_level))
        .unwrap_or_else(|| panic!("a {kind}"));
    assert!(
        !document.contains("{{"),
        "render the chart first: {document}"
    );
    let role: serde_yaml_ng::Value = serde_yaml_ng::from_str(document).expect("the role as YAML");
    let mut granted = BTreeSet::new();
    for rule in role["rules"].as_sequence().expect("rules") {
        let list = |key: &str| -> Vec<String> {
            rule[key]
                .as_sequence()
                .unwrap_or_else(|| panic!("rules[].{key}"))
                .iter()
                .map(|v| v.as_str().expect("a string").to_owned())
                .collect()
        };
        for group in list("apiGroups") {
            for resource in list("resources") {
                for verb in list("verbs") {
                    assert!(
                        !(group == "*" || resource == "*" || verb == "*"),
                        "a wildcard in the {kind}: {group}/{resource}:{verb}"
                    );
                    granted.insert(format!("{group}/{resource}:{verb}"));
                }
            }
        }
    }
    granted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|item| (*item).to_owned()).collect()
    }

    #[test]
    fn requests_map_to_the_permissions_the_api_server_checks() {
        assert_eq!(
            needed_by("GET", "/api/v1/namespaces/shop/services/orders"),
            set(&["/services:get"])
        );
        assert_eq!(
            needed_by(
                "GET",
                "/apis/batch/v1/namespaces/shop/jobs?&labelSelector=a%3Db"
            ),
            set(&["batch/jobs:list"])
        );
        assert_eq!(
            needed_by(
                "GET",
                "/apis/eddy.dev/v1alpha1/subscriptions?watch=true&timeoutSeconds=290"
            ),
            set(&["eddy.dev/subscriptions:watch"])
        );
        assert_eq!(
            needed_by(
                "PATCH",
                "/apis/apps/v1/namespaces/shop/deployments/f?&force=true&fieldManager=eddy"
            ),
            set(&["apps/deployments:patch", "apps/deployments:create"])
        );
        assert_eq!(
            needed_by(
                "PATCH",
                "/apis/eddy.dev/v1alpha1/namespaces/shop/functions/f/status?&fieldManager=eddy"
            ),
            set(&["eddy.dev/functions/status:patch"])
        );
        assert_eq!(
            needed_by("DELETE", "/api/v1/namespaces/shop/configmaps/f-1"),
            set(&["/configmaps:delete"])
        );
        assert_eq!(
            needed_by(
                "DELETE",
                "/api/v1/namespaces/shop/configmaps?labelSelector=x"
            ),
            set(&["/configmaps:deletecollection"])
        );
    }

    #[test]
    fn cluster_roles_are_read_rule_by_rule() {
        let template = "kind: ServiceAccount\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: eddy-x\nrules:\n  - apiGroups: [\"\", apps]\n    resources: [pods, deployments]\n    verbs: [get]\n";
        assert_eq!(
            granted_by_cluster_role(template),
            set(&[
                "/pods:get",
                "/deployments:get",
                "apps/pods:get",
                "apps/deployments:get"
            ])
        );
    }
}
