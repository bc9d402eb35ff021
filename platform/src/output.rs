//! Lines for people watching a terminal.

use std::{io::Write as _, sync::OnceLock};

/// Prints lines instead of stdout, once a terminal display (progress bars) owns the screen.
type Printer = Box<dyn Fn(&str) + Send + Sync>;

static PRINTER: OnceLock<Printer> = OnceLock::new();

/// Sends every later [`say`] through `printer` (a progress display printing above its bars);
/// the first one set stays.
pub fn print_through(printer: Printer) {
    let _ = PRINTER.set(printer);
}

/// Prints a line to stdout; a closed stdout (the reader went away) is not an error worth
/// stopping a server for, so write errors are ignored (`println!` would panic).
pub fn say(line: impl std::fmt::Display) {
    if let Some(printer) = PRINTER.get() {
        printer(&line.to_string());
        return;
    }
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}
