//! What `eddy up` shows while it runs: a progress bar per build that installs dependencies,
//! drawn above the status lines on a terminal, or one line per step when the output is not a
//! terminal (a pipe, a log collector, the tests).

use std::{collections::HashMap, io::IsTerminal as _, time::Duration};

use eddy_controller::local::progress::{BuildEvent, BuildProgress, Phase};
use eddy_platform::{output::say, shutdown::CancellationToken};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::sync::broadcast::error::RecvError;

/// Steps of a build's bar: runtime, source, dependencies, built.
const STEPS: u64 = 4;

/// Shows builds until `shutdown`.
pub async fn show_builds(progress: BuildProgress, shutdown: CancellationToken) {
    let mut events = progress.subscribe();
    let mut display = if std::io::stdout().is_terminal() {
        Display::bars()
    } else {
        Display::Lines
    };
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = events.recv() => event,
        };
        match event {
            Ok(event) => display.show(event),
            // A display that fell behind skips what it missed.
            Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => return,
        }
    }
}

enum Display {
    /// Bars, one per build installing dependencies.
    Bars {
        multi: MultiProgress,
        bars: HashMap<String, ProgressBar>,
        style: ProgressStyle,
    },
    /// Plain lines.
    Lines,
}

impl Display {
    fn bars() -> Self {
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stdout());
        // Status lines go above the bars, not through them.
        let printer = multi.clone();
        eddy_platform::output::print_through(Box::new(move |line| {
            if printer.println(line).is_err() {
                println!("{line}");
            }
        }));
        let style = ProgressStyle::with_template(
            "build       {prefix:<24} {spinner} [{bar:16}] {elapsed:>3} {wide_msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        Self::Bars {
            multi,
            bars: HashMap::new(),
            style,
        }
    }

    fn show(&mut self, BuildEvent { function, phase }: BuildEvent) {
        match self {
            Self::Lines => match phase {
                Phase::Installing { tool } => {
                    say(format!(
                        "build       {function:<32} installing dependencies ({tool})"
                    ));
                }
                Phase::Built {
                    installed: true,
                    seconds,
                } => say(format!(
                    "build       {function:<32} dependencies installed, built  [{seconds:.1}s]"
                )),
                Phase::Failed(why) => say(format!("build       {function:<32} failed: {why}")),
                _ => {}
            },
            Self::Bars { multi, bars, style } => match phase {
                // A bar only for builds that install something: the others take milliseconds.
                Phase::Installing { tool } => {
                    let bar = multi.add(ProgressBar::new(STEPS));
                    bar.set_style(style.clone());
                    bar.set_prefix(function.clone());
                    bar.set_position(2);
                    bar.set_message(format!("{tool}…"));
                    bar.enable_steady_tick(Duration::from_millis(120));
                    if let Some(old) = bars.insert(function, bar) {
                        old.finish_and_clear();
                    }
                }
                Phase::Output(line) => {
                    if let Some(bar) = bars.get(&function) {
                        bar.set_message(line);
                    }
                }
                Phase::Built { seconds, .. } => {
                    if let Some(bar) = bars.remove(&function) {
                        bar.set_position(STEPS);
                        bar.finish_with_message(format!("built in {seconds:.1}s"));
                    }
                }
                Phase::Failed(why) => match bars.remove(&function) {
                    Some(bar) => bar.abandon_with_message(format!("failed: {why}")),
                    None => say(format!("build       {function:<32} failed: {why}")),
                },
                Phase::Runtime | Phase::Source => {}
            },
        }
    }
}
