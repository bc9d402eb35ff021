//! The conditions a Function's and a Subscription's status carry: their types and reasons, the
//! same words from both controller backends (local and Kubernetes) wherever they mean the same.

/// What a condition is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConditionType {
    /// A Function's spec is valid.
    ConfigurationReady,
    /// A Function's build.
    BuildReady,
    /// A Function's instances (local) or Deployment (Kubernetes).
    Running,
    /// A Subscription delivers.
    Ready,
    /// Kyma's condition that a Subscription's consumers deliver (`Subscription active`), set
    /// on Subscriptions applied in Kyma's form beside `Ready`: Kyma's tools wait for it.
    KymaSubscriptionActive,
    /// Kyma's condition that a Subscription's spec is valid (`Subscription spec valid`).
    KymaSubscriptionSpecValid,
}

impl ConditionType {
    /// The name status shows.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConfigurationReady => "ConfigurationReady",
            Self::BuildReady => "BuildReady",
            Self::Running => "Running",
            Self::Ready => "Ready",
            Self::KymaSubscriptionActive => "Subscription active",
            Self::KymaSubscriptionSpecValid => "Subscription spec valid",
        }
    }
}

/// Why a condition is as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    // ConfigurationReady
    /// The spec passed validation.
    ConfigurationValid,
    /// The spec did not (the message names the fields).
    ValidationFailed,
    /// A Secret or ConfigMap (or one of its keys) the spec reads is missing (local).
    ReferenceNotFound,
    /// The Function's security contexts ask for more than the operator's Pod Security level
    /// allows (Kubernetes; the message names the fields).
    SecurityContextRefused,
    // BuildReady
    /// A build runs.
    BuildRunning,
    /// The build succeeded.
    BuildSucceeded,
    /// An earlier build of the same source and dependencies was reused (local).
    BuildReused,
    /// The build failed (the message says how).
    BuildFailed,
    /// The build ran past its timeout (local).
    BuildTimeout,
    /// A tool the build needs (npm, python) is missing (local).
    BuildToolMissing,
    /// Installing the dependencies failed (locally, or in a buildless pod's `install` init
    /// container on Kubernetes; the message has npm's or pip's own error).
    DependencyInstallFailed,
    /// The Git repository could not be read at the reference (local).
    SourceUnavailable,
    /// Nothing to build: the runtime image takes the sources and installs the dependencies
    /// when a pod starts (Kubernetes, `--build buildless`).
    Buildless,
    // Running
    /// Nothing to run yet: waiting for the first build.
    Building,
    /// No instance while idle; the next request starts one.
    ScaledToZero,
    /// Instances are starting (local).
    Starting,
    /// Instances serve (local).
    Running,
    /// Instances keep failing and are restarted with backoff (local).
    InstanceFailing,
    /// The Deployment's pods are not available yet (Kubernetes).
    DeploymentPending,
    /// A rollout has not finished: its new pods are not all available yet (Kubernetes; Kyma's
    /// reason).
    DeploymentWaiting,
    /// Every replica is available (Kubernetes).
    DeploymentReady,
    /// The rollout exceeded its progress deadline (Kubernetes).
    DeploymentFailed,
    /// The API server refused an object (Kubernetes).
    ApplyFailed,
    // Ready (Subscription)
    /// The consumer exists; events are delivered.
    ConsumerReady,
    /// The Subscription is invalid.
    Invalid,
    /// The dispatcher has not created the consumer yet.
    ConsumerNotReady,
    /// The sink names a function that does not exist or has no address yet.
    SinkNotFound,
    // Kyma's Subscription conditions, in Kyma's words (its JetStream backend's).
    /// `Subscription active` holds.
    KymaNatsSubscriptionActive,
    /// `Subscription active` does not hold (the message says why).
    KymaNatsSubscriptionNotActive,
    /// `Subscription spec valid` holds.
    KymaSpecHasNoValidationErrors,
    /// `Subscription spec valid` does not hold (the message names the fields).
    KymaSpecHasValidationErrors,
}

impl Reason {
    /// The word status shows.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConfigurationValid => "ConfigurationValid",
            Self::ValidationFailed => "ValidationFailed",
            Self::ReferenceNotFound => "ReferenceNotFound",
            Self::SecurityContextRefused => "SecurityContextRefused",
            Self::BuildRunning => "BuildRunning",
            Self::BuildSucceeded => "BuildSucceeded",
            Self::BuildReused => "BuildReused",
            Self::BuildFailed => "BuildFailed",
            Self::BuildTimeout => "BuildTimeout",
            Self::BuildToolMissing => "BuildToolMissing",
            Self::Buildless => "Buildless",
            Self::DependencyInstallFailed => "DependencyInstallFailed",
            Self::SourceUnavailable => "SourceUnavailable",
            Self::Building => "Building",
            Self::ScaledToZero => "ScaledToZero",
            Self::Starting => "Starting",
            Self::Running => "Running",
            Self::InstanceFailing => "InstanceFailing",
            Self::DeploymentPending => "DeploymentPending",
            Self::DeploymentWaiting => "DeploymentWaiting",
            Self::DeploymentReady => "DeploymentReady",
            Self::DeploymentFailed => "DeploymentFailed",
            Self::ApplyFailed => "ApplyFailed",
            Self::ConsumerReady => "ConsumerReady",
            Self::Invalid => "Invalid",
            Self::ConsumerNotReady => "ConsumerNotReady",
            Self::SinkNotFound => "SinkNotFound",
            Self::KymaNatsSubscriptionActive => "NATS Subscription active",
            Self::KymaNatsSubscriptionNotActive => "NATS Subscription not active",
            Self::KymaSpecHasNoValidationErrors => "Subscription spec has no validation errors",
            Self::KymaSpecHasValidationErrors => "Subscription spec has validation errors",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
