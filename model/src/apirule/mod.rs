//! Kyma's APIRule (`gateway.kyma-project.io/v2`, and `v2alpha1` read the same): which host
//! exposes a Function, and who may call which path with which method. Types, validation, and
//! the pure decisions the gateways make with it: path templates (`/*`, `{*}`, `{**}`), which
//! rule a request falls under (Kyma's order and exclusions), and the host a short name means.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::resources::{FieldError, is_dns1123_label};

/// The API group of Kyma's APIRule.
pub const GROUP: &str = "gateway.kyma-project.io";
/// The version eddy stores.
pub const VERSION: &str = "v2";
/// The older version read the same.
pub const VERSION_ALPHA: &str = "v2alpha1";
/// `gateway.kyma-project.io/v2`.
pub const API_VERSION: &str = "gateway.kyma-project.io/v2";
/// `gateway.kyma-project.io/v2alpha1`.
pub const API_VERSION_ALPHA: &str = "gateway.kyma-project.io/v2alpha1";
/// The methods a rule may list (Kyma's enum).
pub const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];
/// The timeout of a rule that sets none, as Kyma's.
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 180;
/// The longest timeout a rule may set, as Kyma's.
pub const MAX_TIMEOUT_SECONDS: u32 = 3900;

mod hosts;
mod path;
mod types;
mod validate;

pub use self::{hosts::*, path::*, types::*, validate::*};

/// Why an APIRule is not honoured, as its status describes it (both modes, both the gateway
/// and the controller).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotHonoured {
    /// Its spec is refused, or names what the gateway lacks; each error names its field.
    #[error("{}", crate::resources::describe_errors(.0))]
    Invalid(Vec<FieldError>),
    /// Rules an earlier rule hides (Kyma puts such an APIRule in Error).
    #[error("{}", .0.join("; "))]
    HiddenRules(Vec<String>),
    /// A host an older APIRule holds.
    #[error(transparent)]
    HostTaken(#[from] HostTaken),
}
#[cfg(test)]
mod tests {
    use super::*;

    fn template(path: &str) -> PathTemplate {
        PathTemplate::parse(path).unwrap()
    }

    #[test]
    fn path_templates_match_as_kyma_documents_them() {
        let cases: [(&str, &[&str], &[&str]); 7] = [
            ("/*", &["/", "/a", "/a/b/c"], &[]),
            ("/", &["/"], &["/a"]),
            (
                "/example/one",
                &["/example/one"],
                &["/example/one/", "/example", "/example/two"],
            ),
            (
                "/example/{*}",
                &["/example/anything", "/example/"],
                &["/example/a/b"],
            ),
            (
                "/example/{*}/one",
                &["/example/anything/one", "/example/two/one"],
                &["/example/one", "/example/a/b/one"],
            ),
            (
                "/example/{**}",
                &[
                    "/example/anything",
                    "/example/anything/more",
                    "/example/",
                    "/example",
                ],
                &["/other"],
            ),
            (
                "/example/{**}/one",
                &[
                    "/example/anything/two/one",
                    "/example/anything/one",
                    "/example/one",
                ],
                &["/example/anything"],
            ),
        ];
        for (path, matching, other) in cases {
            let template = template(path);
            for request in matching {
                assert!(template.matches(request), "{path} should match {request}");
            }
            for request in other {
                assert!(
                    !template.matches(request),
                    "{path} should not match {request}"
                );
            }
        }
        assert!(template("/{*}/example/{*}/*").matches("/anything/example/anything/more"));
        assert!(template("/.*").matches("/x/y"));
    }

    #[test]
    fn bad_paths_are_refused() {
        for path in ["orders", "/a*", "/{**}/{**}", "/a/{x}", "/a b", "/{**}/{*}"] {
            assert!(
                PathTemplate::parse(path).is_err(),
                "{path} should be refused"
            );
        }
    }

    fn rules(list: &[(&str, &[&str])]) -> Vec<(PathTemplate, Vec<String>)> {
        list.iter()
            .map(|(path, methods)| {
                (
                    template(path),
                    methods.iter().map(|m| (*m).to_owned()).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn the_first_matching_rule_applies_with_kymas_exclusions() {
        // Kyma's ordering example: rule 1 (GET) hides /anything/one from rule 2 for POST too.
        let excluding = rules(&[
            ("/anything/one", &["GET"]),
            ("/anything/{**}", &["GET", "POST"]),
        ]);
        assert_eq!(select_rule(&excluding, "GET", "/anything/one"), Some(0));
        assert_eq!(select_rule(&excluding, "POST", "/anything/one"), None);
        assert_eq!(select_rule(&excluding, "POST", "/anything/two"), Some(1));
        assert_eq!(select_rule(&excluding, "DELETE", "/anything/two"), None);
        // Its fix: separate rules per method.
        let fixed = rules(&[
            ("/anything/one", &["GET"]),
            ("/anything/{**}", &["GET"]),
            ("/anything/{**}", &["POST"]),
        ]);
        assert_eq!(select_rule(&fixed, "POST", "/anything/one"), Some(2));
        assert_eq!(select_rule(&fixed, "GET", "/anything/two"), Some(1));
    }

    #[test]
    fn hosts_compare_without_port_and_short_hosts_take_the_domain() {
        assert_eq!(request_host("Hello.localhost:8080"), "hello.localhost");
        assert_eq!(request_host("shop.example.com."), "shop.example.com");
        assert_eq!(request_host("[::1]:8080"), "::1");
        assert_eq!(full_host("hello", "localhost"), "hello.localhost");
        assert_eq!(
            full_host("shop.example.com", "localhost"),
            "shop.example.com"
        );
    }

    #[test]
    fn validation_names_each_field() {
        let rule: APIRule = serde_json::from_value(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "APIRule", "metadata": {"name": "r"},
            "spec": {
                "hosts": ["Bad_Host"],
                "rules": [
                    {"path": "/a*", "methods": ["FETCH"], "noAuth": true},
                    {"path": "/*", "methods": ["GET"], "extAuth": {"authorizers": [""],
                     "restrictions": {"authentications": [{"issuer": "", "jwksUri": "https://i/jwks"}]}},
                     "service": {"name": "s", "port": 70000}},
                    {"path": "/x", "methods": ["GET"], "jwt": {"authentications": [{"issuer": "i", "jwksUri": "http://example.com/jwks"}]},
                     "service": {"name": "s", "port": 80}},
                ],
            },
        }))
        .unwrap();
        let fields: Vec<String> = validate_api_rule(&rule)
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(
            fields,
            [
                "spec.hosts[0]",
                "spec.rules[0].path",
                "spec.rules[0].methods[0]",
                "spec.rules[0].service",
                "spec.rules[1].service.port",
                "spec.rules[1].extAuth.authorizers[0]",
                "spec.rules[1].extAuth.restrictions.authentications[0].issuer",
                "spec.rules[2].jwt.authentications[0].jwksUri",
            ]
        );
    }

    #[test]
    fn no_apirule_takes_a_name_the_gateway_answers_to() {
        let rule = |hosts: &[&str]| -> APIRule {
            serde_json::from_value(serde_json::json!({
                "apiVersion": API_VERSION, "kind": "APIRule", "metadata": {"name": "r"},
                "spec": {"hosts": hosts, "service": {"name": "s", "port": 80},
                         "rules": [{"path": "/*", "methods": ["GET"], "noAuth": true}]},
            }))
            .unwrap()
        };
        let own = [
            "localhost".to_owned(),
            "eddy-gateway.eddy-system.svc.cluster.local".to_owned(),
            "*".to_owned(),
        ];
        let taken = |hosts: &[&str]| -> Vec<String> {
            check_gateway_hosts(&rule(hosts), "example.com", &own)
                .into_iter()
                .map(|e| e.field)
                .collect()
        };
        assert!(taken(&["shop", "*", "a.example.com", "*.shop.example.com"]).is_empty());
        assert_eq!(taken(&["example.com"]), ["spec.hosts[0]"]);
        // One label is under the domain: `localhost` is `localhost.example.com`, no gateway name.
        assert!(taken(&["localhost"]).is_empty());
        assert_eq!(taken(&["*.svc.cluster.local"]), ["spec.hosts[0]"]);
        assert_eq!(
            taken(&["eddy-gateway.eddy-system.svc.cluster.local"]),
            ["spec.hosts[0]"]
        );
        // `*` under `localhost` matches names under it, never `localhost` itself.
        assert!(check_gateway_hosts(&rule(&["*"]), "localhost", &own).is_empty());
        assert_eq!(
            check_gateway_hosts(
                &rule(&["localhost.localhost"]),
                "localhost",
                &["localhost.localhost:8080".to_owned()]
            )
            .len(),
            1
        );
    }

    #[test]
    fn kymas_trap_is_found() {
        let spec: ApiRuleSpec = serde_json::from_value(serde_json::json!({
            "hosts": ["h"], "service": {"name": "s", "port": 80},
            "rules": [
                {"path": "/anything/one", "methods": ["GET"], "noAuth": true},
                {"path": "/anything/{**}", "methods": ["GET", "POST"], "noAuth": true},
            ],
        }))
        .unwrap();
        assert!(spec.warnings().is_empty());
        let warnings = spec.hidden_rules();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("spec.rules[1] does not apply to /anything/one"),
            "{warnings:?}"
        );
    }

    #[test]
    fn wildcard_hosts_are_taken_and_matched_most_specific_first() {
        for good in ["*", "*.example.com", "*.shop.example.com", "shop"] {
            assert!(is_host(good), "{good}");
        }
        for bad in [
            "*example.com",
            "a*.example.com",
            "shop.*.com",
            "*.",
            "**.example.com",
            // Addresses, and wildcards that could match one, are no hosts.
            "127.0.0.1",
            "*.0.0.1",
            "*.1",
            "10.0.0.42",
            "::1",
            "[::1]",
            // inet_aton's forms (Python's urllib, wget): each of these is 127.0.0.1 to it,
            // and a name ending in a number is an IPv4 address to the WHATWG URL parser.
            "127.0.0.0x1",
            "0x7f.0.0.0x1",
            "0x7f.1",
            "127.1",
            "0177.0.0.01",
            "*.0x1",
            "*.0X7F",
            "*.0x",
            "shop.example.0x1f",
        ] {
            assert!(!is_host(bad), "{bad}");
        }
        // A label that only starts like a number is a name.
        for good in [
            "shop.0xcafe-store.com",
            "0x1.example.com",
            "api.x0x1",
            "0x1",
        ] {
            assert!(is_host(good), "{good}");
        }
        for address in [
            "127.0.0.1",
            "::1",
            "127.0.0.0x1",
            "0x7f.1",
            "2130706433",
            "a.0x",
        ] {
            assert!(reads_as_address(address), "{address}");
        }
        for name in ["localhost", "shop.example.com", "0x1.example.com", "x.0xg"] {
            assert!(!reads_as_address(name), "{name}");
        }
        assert_eq!(full_host("*", "localhost"), "*.localhost");
        assert_eq!(wildcard_suffix("*.example.com"), Some(".example.com"));
        assert_eq!(wildcard_suffix("shop.example.com"), None);
        let suffixes: Vec<&str> = host_suffixes("a.b.example.com").collect();
        assert_eq!(suffixes, [".b.example.com", ".example.com", ".com"]);
    }
}
