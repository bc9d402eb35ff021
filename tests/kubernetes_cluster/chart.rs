//! The chart: it installs with each values set, and its CRDs are accepted.

use super::*;

#[tokio::test]
async fn the_chart_installs_with_each_values_set_and_its_crds_are_accepted() {
    let _serial = serial().await;
    let plane = ControlPlane::shared().unwrap();
    let admin = plane.client().await.unwrap();
    // Kyma compatibility: the shared release.
    shared_release(plane).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let chart = chart_copy(dir.path()).unwrap();
    for (release, values) in [
        ("external-nats", "external-nats-values.yaml"),
        ("istio-off", "istio-off-values.yaml"),
    ] {
        let namespace = plane.namespace(&admin, release).await.unwrap();
        let output = helm_install(plane, &chart, release, &namespace, &[values], &[]).unwrap();
        assert!(output.contains("STATUS: deployed"), "{output}");
        run(plane
            .helm()
            .unwrap()
            .args(["uninstall", release, "--namespace", &namespace]))
        .unwrap();
        plane.delete_namespace(&admin, &namespace).await.unwrap();
    }
    // Every CRD the chart and `eddy crds` carry is served.
    let crds = run(plane.kubectl().unwrap().args(["get", "crds", "-o", "name"])).unwrap();
    for crd in [
        "functions.eddy.dev",
        "subscriptions.eddy.dev",
        "functions.serverless.kyma-project.io",
        "subscriptions.eventing.kyma-project.io",
    ] {
        assert!(crds.contains(crd), "{crd} missing: {crds}");
    }
    let printed = run(Command::new(env!("CARGO_BIN_EXE_eddy")).arg("crds")).unwrap();
    let mut apply = plane.kubectl().unwrap();
    apply.args([
        "apply",
        "--server-side",
        "--force-conflicts",
        "--dry-run=server",
        "-f",
        "-",
    ]);
    if let Err(error) = run_with_input(&mut apply, &printed) {
        panic!("the API server refuses `eddy crds`: {error:#}");
    }
}
