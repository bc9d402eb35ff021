//! The Pod Security Standards a Function's pod template is held to: which of its settings
//! each level (`baseline`, `restricted`) refuses, checked before anything is applied.

use super::{PodSecurityContext, SecurityContext};

/// The Pod Security Standards level a Function's own security contexts (`podSecurityContext`,
/// `containerSecurityContext`) must meet: what the operator lets Function authors ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PodSecurityLevel {
    /// Kubernetes' `restricted` profile (the default): non-root, no privilege escalation, no
    /// capability beyond `NET_BIND_SERVICE`, every other one dropped, a confined seccomp profile.
    Restricted,
    /// Kubernetes' `baseline` profile: no privileged container, only the default capabilities,
    /// no unconfined seccomp or AppArmor, no custom `procMount` or SELinux user or role.
    Baseline,
    /// Anything the API server takes.
    Privileged,
}

/// Capabilities the `baseline` profile allows to be added.
pub(super) const BASELINE_CAPABILITIES: [&str; 13] = [
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

/// Where the function's pod breaks `level`, each naming the Function's field; judged on what
/// the pods would run (eddy's defaults with the Function's contexts over them), as the
/// Pod Security admission would judge it. Pure.
pub fn pod_security_violations(
    pod: &PodSecurityContext,
    container: &SecurityContext,
    level: PodSecurityLevel,
) -> Vec<String> {
    let mut violations = Vec::new();
    if level == PodSecurityLevel::Privileged {
        return violations;
    }
    let profile = match level {
        PodSecurityLevel::Restricted => "restricted",
        _ => "baseline",
    };
    let mut refuse = |field: &str, why: &str| {
        violations.push(format!(
            "{field}: {why} (the {profile} Pod Security profile the operator set)"
        ));
    };
    const POD: &str = "spec.podSecurityContext";
    const CONTAINER: &str = "spec.containerSecurityContext";
    // Baseline, and so restricted too.
    if container.privileged == Some(true) {
        refuse(&format!("{CONTAINER}.privileged"), "must not be true");
    }
    let added = container
        .capabilities
        .as_ref()
        .and_then(|c| c.add.as_deref())
        .unwrap_or_default();
    for capability in added {
        let name = capability.trim_start_matches("CAP_");
        let allowed = match level {
            PodSecurityLevel::Restricted => name == "NET_BIND_SERVICE",
            _ => BASELINE_CAPABILITIES.contains(&name),
        };
        if !allowed {
            refuse(
                &format!("{CONTAINER}.capabilities.add"),
                &format!("{capability} may not be added"),
            );
        }
    }
    if container
        .proc_mount
        .as_deref()
        .is_some_and(|m| m != "Default")
    {
        refuse(&format!("{CONTAINER}.procMount"), "must be Default");
    }
    let unconfined = |profile: Option<&str>| profile == Some("Unconfined");
    for (field, seccomp) in [
        (POD, pod.seccomp_profile.as_ref()),
        (CONTAINER, container.seccomp_profile.as_ref()),
    ] {
        if unconfined(seccomp.map(|p| p.type_.as_str())) {
            refuse(
                &format!("{field}.seccompProfile.type"),
                "must not be Unconfined",
            );
        }
    }
    for (field, apparmor) in [
        (POD, pod.app_armor_profile.as_ref()),
        (CONTAINER, container.app_armor_profile.as_ref()),
    ] {
        if unconfined(apparmor.map(|p| p.type_.as_str())) {
            refuse(
                &format!("{field}.appArmorProfile.type"),
                "must not be Unconfined",
            );
        }
    }
    for (field, selinux) in [
        (POD, pod.se_linux_options.as_ref()),
        (CONTAINER, container.se_linux_options.as_ref()),
    ] {
        let Some(selinux) = selinux else { continue };
        if selinux.type_.as_deref().is_some_and(|t| {
            ![
                "",
                "container_t",
                "container_init_t",
                "container_kvm_t",
                "container_engine_t",
            ]
            .contains(&t)
        }) {
            refuse(
                &format!("{field}.seLinuxOptions.type"),
                "is not a container type",
            );
        }
        if selinux.user.as_deref().is_some_and(|u| !u.is_empty())
            || selinux.role.as_deref().is_some_and(|r| !r.is_empty())
        {
            refuse(
                &format!("{field}.seLinuxOptions"),
                "must not set user or role",
            );
        }
    }
    if pod.sysctls.as_ref().is_some_and(|s| !s.is_empty()) {
        refuse(&format!("{POD}.sysctls"), "must not be set");
    }
    for (field, windows) in [
        (POD, pod.windows_options.as_ref()),
        (CONTAINER, container.windows_options.as_ref()),
    ] {
        if windows.and_then(|w| w.host_process) == Some(true) {
            refuse(
                &format!("{field}.windowsOptions.hostProcess"),
                "must not be true",
            );
        }
    }
    if level == PodSecurityLevel::Baseline {
        return violations;
    }
    // Restricted.
    if container.allow_privilege_escalation != Some(false) {
        refuse(
            &format!("{CONTAINER}.allowPrivilegeEscalation"),
            "must be false",
        );
    }
    let non_root = container.run_as_non_root.or(pod.run_as_non_root);
    if non_root != Some(true) {
        let field = if container.run_as_non_root.is_some() {
            CONTAINER
        } else {
            POD
        };
        refuse(&format!("{field}.runAsNonRoot"), "must be true");
    }
    for (field, user) in [(POD, pod.run_as_user), (CONTAINER, container.run_as_user)] {
        if user == Some(0) {
            refuse(&format!("{field}.runAsUser"), "must not be 0");
        }
    }
    let dropped = container
        .capabilities
        .as_ref()
        .and_then(|c| c.drop.as_deref())
        .unwrap_or_default();
    if !dropped.iter().any(|c| c == "ALL") {
        refuse(
            &format!("{CONTAINER}.capabilities.drop"),
            "must include ALL",
        );
    }
    let confined = |profile: Option<&str>| matches!(profile, Some("RuntimeDefault" | "Localhost"));
    let seccomp = container
        .seccomp_profile
        .as_ref()
        .or(pod.seccomp_profile.as_ref())
        .map(|p| p.type_.as_str());
    if !confined(seccomp) {
        refuse(
            &format!("{CONTAINER}.seccompProfile.type"),
            "must be RuntimeDefault or Localhost",
        );
    }
    violations
}
