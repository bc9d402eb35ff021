//! Control groups for local function instances (`eddy up --isolation cgroup`): each instance
//! runs in a cgroup of its own with a memory limit (its Function's, as on Kubernetes) and a cap
//! on its processes and threads, and stopping the instance kills everything in the cgroup,
//! daemons that double-forked out of its process group included.
//!
//! Both cgroup versions are supported. Version 1 (a `memory` and a `pids` hierarchy) needs
//! root; version 2 needs write access to eddy's own cgroup with the `memory` and `pids`
//! controllers available there (root, or a cgroup delegated to the user, e.g. `systemd-run
//! --user --scope -p Delegate=yes eddy up …`).

use std::{
    fs::File,
    io::Write as _,
    os::fd::{AsFd as _, AsRawFd as _},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use nix::{sys::signal::Signal, unistd::Pid};

/// Where cgroups are mounted.
const MOUNT: &str = "/sys/fs/cgroup";

use crate::Error;

fn failed(what: impl std::fmt::Display, path: &Path, error: std::io::Error) -> Error {
    Error::Cgroup(format!("{what} {}: {error}", path.display()))
}

/// Limits of one cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    /// Bytes of memory (none: unlimited).
    pub memory_bytes: Option<u64>,
    /// Processes and threads together (none: unlimited).
    pub max_tasks: Option<u64>,
}

/// The version in use and the directory eddy's cgroups go under, per hierarchy.
#[derive(Debug, Clone)]
enum Layout {
    /// One unified hierarchy.
    V2 { base: PathBuf },
    /// Separate `memory` and `pids` hierarchies.
    V1 { memory: PathBuf, pids: PathBuf },
}

/// The parent of every instance's cgroup, created once per `eddy up` (and removed with it).
#[derive(Debug)]
pub struct Cgroups {
    layout: Layout,
}

impl Cgroups {
    /// Creates the parent cgroup `<prefix>-<pid of this process>`, or says why cgroups cannot
    /// be used here. What a process of the same prefix that is gone left behind (it was
    /// SIGKILLed, or exited without dropping its cgroups) is cleared first.
    pub fn new(prefix: &str) -> Result<Self, Error> {
        let name = format!("{prefix}-{}", std::process::id());
        let name = name.as_str();
        let mount = Path::new(MOUNT);
        let layout = if mount.join("cgroup.controllers").exists() {
            let own = own_cgroup_v2()?;
            let parent = mount.join(own.trim_start_matches('/'));
            let available = std::fs::read_to_string(parent.join("cgroup.controllers"))
                .map_err(|e| failed("cannot read", &parent.join("cgroup.controllers"), e))?;
            for controller in ["memory", "pids"] {
                if !available.split_whitespace().any(|c| c == controller) {
                    return Err(Error::Cgroup(format!(
                        "the {controller} controller is not available in {} (cgroup v2): run eddy as root or in a cgroup delegated to you",
                        parent.display()
                    )));
                }
            }
            sweep(&parent, prefix);
            let base = parent.join(name);
            create_dir(&base)?;
            // Children of `base` get memory and pids limits. (`base` holds no process, so
            // cgroup v2's rule against processes in inner cgroups holds.)
            write(&base.join("cgroup.subtree_control"), "+memory +pids")?;
            Layout::V2 { base }
        } else {
            sweep(&mount.join("memory"), prefix);
            sweep(&mount.join("pids"), prefix);
            let memory = mount.join("memory").join(name);
            let pids = mount.join("pids").join(name);
            for hierarchy in [&memory, &pids] {
                create_dir(hierarchy)?;
            }
            Layout::V1 { memory, pids }
        };
        Ok(Self { layout })
    }

    /// Creates the cgroup of one instance with `limits`.
    pub fn create(&self, leaf: &str, limits: Limits) -> Result<Cgroup, Error> {
        let unlimited =
            |value: Option<u64>| value.map_or_else(|| "max".to_owned(), |v| v.to_string());
        match &self.layout {
            Layout::V2 { base } => {
                let dir = base.join(leaf);
                create_dir(&dir)?;
                let cgroup = Cgroup {
                    dirs: vec![dir.clone()],
                    v2: true,
                };
                write(&dir.join("memory.max"), &unlimited(limits.memory_bytes))?;
                // No swap: a function over its limit is stopped, not slowed down.
                let _ = write(&dir.join("memory.swap.max"), "0");
                write(&dir.join("pids.max"), &unlimited(limits.max_tasks))?;
                Ok(cgroup)
            }
            Layout::V1 { memory, pids } => {
                let memory = memory.join(leaf);
                let pids = pids.join(leaf);
                create_dir(&memory)?;
                create_dir(&pids)?;
                let cgroup = Cgroup {
                    dirs: vec![memory.clone(), pids.clone()],
                    v2: false,
                };
                // -1: unlimited.
                let limit = limits
                    .memory_bytes
                    .map_or_else(|| "-1".to_owned(), |v| v.to_string());
                write(&memory.join("memory.limit_in_bytes"), &limit)?;
                let _ = write(&memory.join("memory.memsw.limit_in_bytes"), &limit);
                write(&pids.join("pids.max"), &unlimited(limits.max_tasks))?;
                Ok(cgroup)
            }
        }
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        let dirs = match &self.layout {
            Layout::V2 { base } => vec![base.clone()],
            Layout::V1 { memory, pids } => vec![memory.clone(), pids.clone()],
        };
        for dir in dirs {
            // Instances' cgroups are gone by now; an inner one left behind keeps this one.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Removes `<prefix>-<pid>` cgroups under `parent` whose process is gone, with whatever is
/// still inside (processes killed first).
fn sweep(parent: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix(prefix)?.strip_prefix('-'))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let dir = entry.path();
        if let Ok(leaves) = std::fs::read_dir(&dir) {
            for leaf in leaves.flatten().filter(|leaf| leaf.path().is_dir()) {
                drop(Cgroup {
                    dirs: vec![leaf.path()],
                    v2: false,
                });
            }
        }
        let _ = std::fs::remove_dir(&dir);
    }
}

/// eddy's own cgroup under cgroup v2 (`0::/path` in `/proc/self/cgroup`).
fn own_cgroup_v2() -> Result<String, Error> {
    let path = Path::new("/proc/self/cgroup");
    let text = std::fs::read_to_string(path).map_err(|e| failed("cannot read", path, e))?;
    text.lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(str::to_owned)
        .ok_or_else(|| Error::Cgroup("no cgroup v2 entry in /proc/self/cgroup".to_owned()))
}

fn create_dir(dir: &Path) -> Result<(), Error> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(error) => Err(failed("cannot create the cgroup", dir, error)),
    }
}

fn write(file: &Path, value: &str) -> Result<(), Error> {
    std::fs::write(file, value).map_err(|e| failed(format!("cannot write {value:?} to"), file, e))
}

/// The cgroup of one instance. Dropping it kills what is left in it and removes it.
#[derive(Debug)]
pub struct Cgroup {
    /// One directory (v2), or the memory and the pids one (v1).
    dirs: Vec<PathBuf>,
    v2: bool,
}

impl Cgroup {
    /// The `cgroup.procs` files, opened for `join_in_child`: opened before the fork, so the
    /// child only writes to them.
    fn procs_files(&self) -> Result<Vec<File>, Error> {
        self.dirs
            .iter()
            .map(|dir| {
                let path = dir.join("cgroup.procs");
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|e| failed("cannot open", &path, e))
            })
            .collect()
    }

    /// Makes `command`'s process start in this cgroup: it joins between fork and exec, so
    /// nothing it runs is ever outside.
    pub fn join_on_spawn(&self, command: &mut std::process::Command) -> Result<(), Error> {
        use std::os::unix::process::CommandExt as _;
        let files = self.procs_files()?;
        #[allow(unsafe_code)]
        // SAFETY: join_in_child only calls write(2) on descriptors opened before the fork.
        unsafe {
            command.pre_exec(move || join_in_child(&files));
        }
        Ok(())
    }

    /// Moves the running process `pid` (a warm spare about to become this instance) in.
    pub fn add(&self, pid: u32) -> Result<(), Error> {
        for file in self.procs_files()? {
            let mut file = file;
            file.write_all(pid.to_string().as_bytes())
                .map_err(|e| failed(format!("cannot move {pid} into"), &self.dirs[0], e))?;
        }
        Ok(())
    }

    /// Whether the kernel killed a process here for going over the memory limit.
    pub fn out_of_memory(&self) -> bool {
        let Some(memory) = self.dirs.first() else {
            return false;
        };
        let (file, key) = if self.v2 {
            ("memory.events", "oom_kill")
        } else {
            ("memory.oom_control", "oom_kill")
        };
        std::fs::read_to_string(memory.join(file))
            .ok()
            .and_then(|text| {
                text.lines().find_map(|line| {
                    let (name, count) = line.split_once(' ')?;
                    (name == key).then(|| count.trim().parse::<u64>().ok())?
                })
            })
            .is_some_and(|count| count > 0)
    }

    /// The processes in it now.
    pub fn pids(&self) -> Vec<i32> {
        let Some(dir) = self.dirs.last() else {
            return Vec::new();
        };
        std::fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.trim().parse().ok())
            .collect()
    }

    /// SIGKILL to every process in it, until none is left (a process forking while it is
    /// killed is caught on the next round).
    pub fn kill_all(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = self.pids();
            if pids.is_empty() || Instant::now() > deadline {
                return;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        self.kill_all();
        for dir in &self.dirs {
            // A killed process leaves its cgroup a moment after it is reaped.
            let deadline = Instant::now() + Duration::from_secs(2);
            while std::fs::remove_dir(dir).is_err() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Run in the child between fork and exec: the child joins each cgroup of `files` (writing
/// `0`, "this process", to its `cgroup.procs`). Only write(2), which is async-signal-safe.
fn join_in_child(files: &[File]) -> std::io::Result<()> {
    for file in files {
        let written = nix::unistd::write(file.as_fd(), b"0")?;
        if written != 1 {
            return Err(std::io::Error::other(format!(
                "short write to cgroup.procs (fd {})",
                file.as_raw_fd()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where cgroups can be made (root, or a delegated v2 cgroup), an instance's cgroup limits
    /// its tasks, takes a child started in it, and leaves nothing behind.
    #[test]
    fn a_cgroup_holds_its_processes_and_kills_them_all_as_root() {
        // scripts/test skips the `_as_root` tests (in its summary) for a user who is not root,
        // except under CI; run by hand without root, a delegated cgroup v2 does as well.
        let cgroups = match Cgroups::new("eddy-test") {
            Ok(cgroups) => cgroups,
            Err(error) => panic!("cgroups cannot be made here (run as root): {error}"),
        };
        let cgroup = cgroups
            .create(
                "instance",
                Limits {
                    memory_bytes: Some(64 * 1024 * 1024),
                    max_tasks: Some(16),
                },
            )
            .unwrap();
        let mut command = std::process::Command::new("sh");
        // A detached grandchild: outside the shell's process group, inside the cgroup.
        command.args(["-c", "setsid sleep 300 & sleep 300"]);
        cgroup.join_on_spawn(&mut command).unwrap();
        let mut child = command.spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while cgroup.pids().len() < 3 {
            assert!(Instant::now() < deadline, "pids: {:?}", cgroup.pids());
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(cgroup.pids().contains(&i32::try_from(child.id()).unwrap()));
        assert!(!cgroup.out_of_memory());
        let dirs = cgroup.dirs.clone();
        drop(cgroup);
        let _ = child.wait();
        for dir in dirs {
            assert!(!dir.exists(), "{} was removed", dir.display());
        }
    }
}
