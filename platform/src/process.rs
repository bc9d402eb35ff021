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

/// The preload library that makes a process non-dumpable as it starts (`nondumpable.c`).
const NONDUMPABLE_LIBRARY: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/libeddy_nondumpable.so"));

/// How local function runtimes are confined beyond their process group and cgroup.
///
/// Every runtime loads a small preload library that makes it non-dumpable before the runtime's
/// own code runs: the secrets an instance gets on stdin stay out of reach of other functions of
/// the same user (`/proc/<pid>/mem`, `environ`, `ptrace`). With `--isolation cgroup` under root,
/// each instance also runs without capabilities (none kept across its `execve`, no way to gain
/// any) and in a mount namespace of its own where `/sys/fs/cgroup` is an empty read-only
/// filesystem: root in uid but unable to raise its own cgroup limits or move itself out of its
/// cgroup.
#[derive(Debug, Clone)]
pub struct Confinement {
    preload: std::path::PathBuf,
    without_privileges: bool,
}

impl Confinement {
    /// Writes the preload library into `dir` (once per version of it) and confines with it;
    /// `without_privileges` as described above.
    pub fn new(dir: &std::path::Path, without_privileges: bool) -> std::io::Result<Self> {
        use sha2::Digest as _;
        use std::os::unix::fs::PermissionsExt as _;
        let digest = sha2::Sha256::digest(NONDUMPABLE_LIBRARY);
        let version: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
        let preload = dir.join(format!("eddy-nondumpable-{version}.so"));
        if std::fs::read(&preload).ok().as_deref() != Some(NONDUMPABLE_LIBRARY) {
            std::fs::create_dir_all(dir)?;
            // Written aside and renamed: an instance starting meanwhile never loads half a file.
            let partial = dir.join(format!(
                ".eddy-nondumpable-{version}.{}",
                std::process::id()
            ));
            std::fs::write(&partial, NONDUMPABLE_LIBRARY)?;
            std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755))?;
            std::fs::rename(&partial, &preload)?;
        }
        Ok(Self {
            preload,
            without_privileges,
        })
    }

    /// Whether instances run without capabilities and without a view of the cgroups.
    pub fn without_privileges(&self) -> bool {
        self.without_privileges
    }

    /// Confines a runtime about to be started by `command` (whose environment is already set:
    /// the preload library goes before any the Function names).
    pub fn apply(&self, command: &mut std::process::Command) {
        let preload = match command
            .get_envs()
            .find(|(name, _)| *name == "LD_PRELOAD")
            .and_then(|(_, value)| value)
        {
            Some(theirs) if !theirs.is_empty() => {
                let mut both = self.preload.clone().into_os_string();
                both.push(":");
                both.push(theirs);
                both
            }
            _ => self.preload.clone().into_os_string(),
        };
        command.env("LD_PRELOAD", preload);
        #[cfg(target_os = "linux")]
        if self.without_privileges {
            use std::os::unix::process::CommandExt as _;
            #[allow(unsafe_code)]
            // SAFETY: the closure runs between fork and exec and makes only system calls
            // (unshare, mount, prctl) with arguments on the stack; it allocates nothing and
            // touches no memory of the parent.
            unsafe {
                command.pre_exec(give_up_privileges);
            }
        }
    }
}

/// In a child about to exec: a mount namespace of its own with `/sys/fs/cgroup` hidden under
/// an empty read-only tmpfs, then every capability dropped for good (bounding and ambient sets
/// emptied, root's exec-time capabilities off and locked, no new privileges).
#[cfg(target_os = "linux")]
fn give_up_privileges() -> std::io::Result<()> {
    use nix::{
        libc,
        mount::{MsFlags, mount},
        sched::{CloneFlags, unshare},
    };
    const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
    const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
    const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;
    const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;
    const SECBIT_KEEP_CAPS_LOCKED: libc::c_ulong = 1 << 5;
    const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
    const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;
    unshare(CloneFlags::CLONE_NEWNS)?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )?;
    mount(
        Some("tmpfs"),
        "/sys/fs/cgroup",
        Some("tmpfs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("size=4k,mode=0555"),
    )?;
    let prctl = |option: libc::c_int, arg: libc::c_ulong| -> std::io::Result<()> {
        #[allow(unsafe_code)]
        // SAFETY: prctl(2) with integer arguments only.
        let result = unsafe {
            libc::prctl(
                option,
                arg,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
        if result == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    for capability in 0..64 {
        match prctl(libc::PR_CAPBSET_DROP, capability) {
            Ok(()) => {}
            // Past the kernel's last capability.
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => break,
            Err(error) => return Err(error),
        }
    }
    prctl(
        libc::PR_CAP_AMBIENT,
        libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
    )?;
    prctl(
        libc::PR_SET_SECUREBITS,
        SECBIT_NOROOT
            | SECBIT_NOROOT_LOCKED
            | SECBIT_NO_SETUID_FIXUP
            | SECBIT_NO_SETUID_FIXUP_LOCKED
            | SECBIT_KEEP_CAPS_LOCKED
            | SECBIT_NO_CAP_AMBIENT_RAISE
            | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED,
    )?;
    nix::sys::prctl::set_no_new_privs().map_err(std::io::Error::from)
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

    /// A process started under the confinement makes itself non-dumpable: the kernel then shows
    /// root as the owner of its `/proc/<pid>/environ`. The same program without it is the
    /// control. Run as root, both run as `nobody` so the owners differ.
    #[test]
    fn confined_processes_are_not_dumpable() {
        use std::os::unix::{
            fs::MetadataExt as _, fs::PermissionsExt as _, process::CommandExt as _,
        };
        let dir = std::env::temp_dir().join(format!("eddy-confinement-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let confinement = Confinement::new(&dir, false).unwrap();
        // Written once: a second confinement reuses the file.
        assert_eq!(
            Confinement::new(&dir, false).unwrap().preload,
            confinement.preload
        );
        let user = if nix::unistd::geteuid().is_root() {
            65534
        } else {
            nix::unistd::geteuid().as_raw()
        };
        let start = |confined: bool| {
            let mut command = std::process::Command::new("sleep");
            command.arg("30");
            if nix::unistd::geteuid().is_root() {
                command.uid(65534).gid(65534);
            }
            if confined {
                confinement.apply(&mut command);
            }
            command.spawn().unwrap()
        };
        let owner = |pid: u32| {
            std::fs::metadata(format!("/proc/{pid}/environ"))
                .unwrap()
                .uid()
        };
        let mut control = start(false);
        let mut confined = start(true);
        // The preload runs before `sleep`'s main: poll until the kernel shows it, bounded.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while owner(confined.id()) != 0 && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        let (control_owner, confined_owner) = (owner(control.id()), owner(confined.id()));
        for child in [&mut control, &mut confined] {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(control_owner, user, "the control stays dumpable");
        assert_eq!(confined_owner, 0, "the confined process is non-dumpable");
    }

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
