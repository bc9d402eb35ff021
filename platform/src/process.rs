//! Child processes that never outlive eddy.
//!
//! Every child eddy starts (nats-server, function instances, builds) runs in its own process
//! group, so that stopping it also stops what it started (npm starts node, shells start tools),
//! and is told by the kernel to terminate when eddy dies, even by SIGKILL (Linux
//! `PR_SET_PDEATHSIG`). The death signal is tied to the spawning thread, so spawn from a runtime
//! worker thread (which lives as long as the process), never from a `spawn_blocking` thread.

use std::time::Duration;

use nix::{
    sys::signal::{Signal, killpg},
    unistd::Pid,
};
use tokio::process::{Child, Command};

/// Puts the child in its own process group and asks the kernel to SIGTERM it when eddy dies.
pub fn supervise(command: &mut Command) {
    command.kill_on_drop(true);
    supervise_std(command.as_std_mut());
}

/// [`supervise`] for a `std` command (the test harness's nats-servers): its own process group,
/// SIGTERM when the spawning thread's process dies. Killing it on drop is the caller's part.
pub fn supervise_std(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    command.process_group(0);
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    // SAFETY: the closure runs between fork and exec and calls only prctl(2), which is
    // async-signal-safe; it touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGTERM).map_err(std::io::Error::from)
        });
    }
}

/// The process group a [`supervise`]d child leads; read it before waiting for the child (a
/// reaped child has no id), to clear out what it left behind afterwards.
pub fn group_of(child: &Child) -> Option<Pid> {
    child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .map(Pid::from_raw)
}

/// SIGKILL to every process left in `group`: what a build started in the background (an npm
/// `postinstall` daemon) does not outlive the build.
pub fn kill_group(group: Pid) {
    // ESRCH (nothing left) is the usual answer.
    let _ = killpg(group, Signal::SIGKILL);
}

/// Hardens a long-running eddy process: the soft open-file limit raised to the hard one (the
/// listeners' connection caps, not the fd limit, decide when to stop accepting), and the process
/// made non-dumpable, so a function or build running as the same user cannot read eddy's
/// memory or environment (tokens) through `/proc/<pid>/environ` or `ptrace`.
pub fn harden() {
    let limit = crate::net::raise_fd_limit();
    tracing::debug!(?limit, "open-file limit");
    #[cfg(target_os = "linux")]
    if let Err(error) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!(%error, "cannot make the process non-dumpable");
    }
}

/// For the CLI: a closed stdout (`eddy get functions | head -1`) ends the command quietly, as it
/// does any Unix tool, instead of `println!` panicking on `EPIPE` (Rust ignores `SIGPIPE`).
/// Never for the services, whose clients may go away at any time.
pub fn quiet_on_closed_pipe() {
    #[cfg(unix)]
    #[allow(unsafe_code)]
    // SAFETY: restores the default disposition; no handler function is installed, so nothing
    // runs in signal context.
    unsafe {
        let _ = nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigDfl,
        );
    }
}

/// Sends `signal` to the child's whole process group.
pub fn signal_group(child: &Child, signal: Signal) {
    if let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) {
        // ESRCH (already gone) is fine.
        let _ = killpg(Pid::from_raw(pid), signal);
    }
}

/// SIGTERM to the group, then SIGKILL after `grace` if it is still there; reaps the child.
/// Only for children started with [`supervise`] (group leaders): signals go to the group.
/// Descendants that left the group (`setsid`, a detached child) are killed afterwards.
pub async fn terminate(child: &mut Child, grace: Duration) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    let left_the_group = descendants(child);
    signal_group(child, Signal::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        signal_group(child, Signal::SIGKILL);
        let _ = child.wait().await;
    }
    kill_all(&left_the_group);
}

/// SIGKILL to the group and to descendants that left it, at once; reaps the child.
pub async fn kill(child: &mut Child) {
    let left_the_group = descendants(child);
    signal_group(child, Signal::SIGKILL);
    let _ = child.wait().await;
    kill_all(&left_the_group);
}

/// A process seen below a child: its pid and start time (clock ticks since boot), so that a pid
/// reused since is not killed.
type Seen = (i32, u64);

/// Every process below `child` (children, theirs, …) as `/proc` shows them now, whatever their
/// group or session: what a function started with `setsid` or as a detached child is not in the
/// function's group, and would outlive it.
fn descendants(child: &Child) -> Vec<Seen> {
    let Some(root) = child.id().and_then(|pid| i32::try_from(pid).ok()) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: std::collections::HashMap<i32, Vec<Seen>> = Default::default();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse().ok())
        else {
            continue;
        };
        if let Some((parent, started)) = parent_and_start(pid) {
            children.entry(parent).or_default().push((pid, started));
        }
    }
    let mut found = Vec::new();
    let mut next = vec![root];
    while let Some(parent) = next.pop() {
        for &(pid, started) in children.get(&parent).into_iter().flatten() {
            found.push((pid, started));
            next.push(pid);
        }
    }
    found
}

/// The parent pid and start time of `pid`, from `/proc/<pid>/stat`.
fn parent_and_start(pid: i32) -> Option<(i32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`: the command may hold spaces and parentheses, so fields are
    // counted from the last `)`. ppid is field 4, starttime field 22.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    let parent = fields.get(1)?.parse().ok()?;
    let started = fields.get(19)?.parse().ok()?;
    Some((parent, started))
}

/// SIGKILL to each of `seen` that is still the same process.
fn kill_all(seen: &[Seen]) {
    for &(pid, started) in seen {
        if parent_and_start(pid).is_some_and(|(_, now)| now == started) {
            // ESRCH (gone meanwhile) is fine.
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hardened_processes_are_not_dumpable_and_may_open_more_files() {
        use nix::sys::resource::{Resource, getrlimit};
        harden();
        #[cfg(target_os = "linux")]
        assert!(!nix::sys::prctl::get_dumpable().unwrap());
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        assert!(
            soft == hard || hard == nix::sys::resource::RLIM_INFINITY,
            "{soft} < {hard}"
        );
    }

    /// Whether `pid` is gone (a zombie waiting for its reaper counts as gone).
    fn gone(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
            stat.rsplit(") ")
                .next()
                .is_some_and(|rest| rest.starts_with('Z'))
        })
    }

    #[tokio::test]
    async fn a_child_that_left_the_group_goes_with_it() {
        use tokio::io::AsyncBufReadExt as _;
        for stop in ["kill", "terminate"] {
            let mut command = Command::new("sh");
            command
                .args(["-c", "setsid sleep 300 & echo $!; wait"])
                .stdout(std::process::Stdio::piped());
            supervise(&mut command);
            let mut child = command.spawn().unwrap();
            let mut line = String::new();
            tokio::io::BufReader::new(child.stdout.take().unwrap())
                .read_line(&mut line)
                .await
                .unwrap();
            let escaped: i32 = line.trim().parse().unwrap();
            assert!(!gone(escaped), "the setsid child runs");
            match stop {
                "kill" => kill(&mut child).await,
                _ => terminate(&mut child, Duration::from_secs(5)).await,
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !gone(escaped) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{stop}: {escaped} outlived its parent"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}
