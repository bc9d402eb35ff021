//! What builds are doing, for whoever shows it (`eddy up` draws a progress bar per build that
//! installs dependencies). Sent on a broadcast channel: nobody listening costs a failed send,
//! a slow listener loses old events, never holds up a build.

use tokio::sync::broadcast;

/// A step of one build.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Making sure the runtime's libraries are installed.
    Runtime,
    /// Writing (or copying) the function's files.
    Source,
    /// Installing the function's dependencies with `tool` (`npm install`, `pip install`).
    Installing {
        /// The installer.
        tool: &'static str,
    },
    /// The installer's latest line of output.
    Output(String),
    /// Done.
    Built {
        /// Whether dependencies were installed.
        installed: bool,
        /// How long the build took.
        seconds: f64,
    },
    /// Failed, with the first line of why.
    Failed(String),
}

/// One step of one function's build.
#[derive(Debug, Clone, PartialEq)]
pub struct BuildEvent {
    /// `namespace/name`.
    pub function: String,
    /// What it is doing now.
    pub phase: Phase,
}

/// Where builds report (cloned into each).
#[derive(Debug, Clone)]
pub struct BuildProgress {
    sender: broadcast::Sender<BuildEvent>,
}

impl Default for BuildProgress {
    fn default() -> Self {
        Self {
            sender: broadcast::channel(256).0,
        }
    }
}

impl BuildProgress {
    /// Every build's events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<BuildEvent> {
        self.sender.subscribe()
    }

    /// The reporter of one function's build.
    pub fn of(&self, function: String) -> Reporter {
        Reporter {
            sender: self.sender.clone(),
            function,
        }
    }
}

/// Reports one function's build.
#[derive(Debug, Clone)]
pub struct Reporter {
    sender: broadcast::Sender<BuildEvent>,
    function: String,
}

impl Reporter {
    /// Says what the build is doing now.
    pub fn report(&self, phase: Phase) {
        // No receiver: nobody is watching, which is fine.
        let _ = self.sender.send(BuildEvent {
            function: self.function.clone(),
            phase,
        });
    }
}

/// Says `phase` to `reporter`, when there is one.
pub fn report(reporter: Option<&Reporter>, phase: Phase) {
    if let Some(reporter) = reporter {
        reporter.report(phase);
    }
}
