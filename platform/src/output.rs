//! Lines for people watching a terminal.

use std::io::Write as _;

/// Prints a line to stdout; a closed stdout (the reader went away) is not an error worth
/// stopping a server for, so write errors are ignored (`println!` would panic).
pub fn say(line: impl std::fmt::Display) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}
