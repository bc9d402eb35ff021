//! The runtime servers, shipped inside the binary. The same files build the container images
//! (`controller/runtimes/<runtime>/Dockerfile`), so local mode and Kubernetes run identical code.

use eddy_model::resources::Runtime;
use sha2::{Digest, Sha256};

/// The Node.js runtimes' server (every Node.js runtime shares it; nodejs26 calls the function
/// with Kyma's new runtime API).
pub const NODEJS_SERVER: &str = include_str!("../runtimes/nodejs/server.mjs");
/// The Node.js runtimes' own libraries, with their versions pinned by the lockfile below.
pub const NODEJS_PACKAGE: &str = include_str!("../runtimes/nodejs/package.json");
/// The lockfile of [`NODEJS_PACKAGE`].
pub const NODEJS_PACKAGE_LOCK: &str = include_str!("../runtimes/nodejs/package-lock.json");
/// The `sdk` module of Kyma's new runtime API for Node.js: installed as the runtime's
/// `node_modules/sdk`, it asks the server, which configured it, for everything.
pub const NODEJS_SDK: &str = include_str!("../runtimes/nodejs/sdk.js");
/// The Python runtimes' server (python311 and python312 share it).
pub const PYTHON_SERVER: &str = include_str!("../runtimes/python/server.py");
/// The Python runtimes' own libraries, pinned with hashes.
pub const PYTHON_REQUIREMENTS: &str = include_str!("../runtimes/python/requirements.txt");
/// The platform's part of every Python runtime (a spare becoming an instance, secrets on stdin),
/// a module shipped beside each Python server.
pub const PYTHON_PLATFORM: &str = include_str!("../runtimes/python/eddy_platform.py");
/// The python314 runtime's server: Kyma's new runtime API (Flask on gevent).
pub const PYTHON314_SERVER: &str = include_str!("../runtimes/python314/server.py");
/// The python314 runtime's own libraries, pinned with hashes as Kyma pins them.
pub const PYTHON314_REQUIREMENTS: &str = include_str!("../runtimes/python314/requirements.txt");

/// The Node.js image recipe (`NODE_MAJOR` picks the Node.js version).
pub const NODEJS_DOCKERFILE: &str = include_str!("../runtimes/nodejs/Dockerfile");
/// The Python image recipe (`PYTHON_VERSION` picks the Python version).
pub const PYTHON_DOCKERFILE: &str = include_str!("../runtimes/python/Dockerfile");

/// File names and contents of one runtime.
#[derive(Debug, Clone, Copy)]
pub struct RuntimeFiles {
    /// The server's file name.
    pub server_file: &'static str,
    /// The server's code.
    pub server: &'static str,
    /// Modules the server imports, written beside it (name, contents).
    pub modules: &'static [(&'static str, &'static str)],
    /// Where the user's code goes.
    pub handler_file: &'static str,
    /// Where the user's dependencies go.
    pub dependencies_file: &'static str,
    /// The container image recipe.
    pub dockerfile: &'static str,
    /// The files that pin the runtime's own libraries (name, contents): installed once per
    /// runtime and shared by every function of it. In an image's build context each name gets
    /// the prefix `runtime-`, so it cannot meet the function's own files.
    pub libraries: &'static [(&'static str, &'static str)],
    /// Where the libraries' install leaves the server bundled into one file (it starts faster
    /// than one that loads its libraries file by file), relative to the libraries' directory.
    pub bundled_server: Option<&'static str>,
}

/// The files of `runtime`.
pub fn files(runtime: Runtime) -> RuntimeFiles {
    match runtime {
        Runtime::Nodejs20 | Runtime::Nodejs22 | Runtime::Nodejs24 | Runtime::Nodejs26 => {
            RuntimeFiles {
                server_file: "server.mjs",
                server: NODEJS_SERVER,
                modules: &[],
                handler_file: "handler.js",
                dependencies_file: "package.json",
                dockerfile: NODEJS_DOCKERFILE,
                libraries: &[
                    ("package.json", NODEJS_PACKAGE),
                    ("package-lock.json", NODEJS_PACKAGE_LOCK),
                    ("sdk.js", NODEJS_SDK),
                ],
                bundled_server: Some("dist/server.mjs"),
            }
        }
        Runtime::Python311 | Runtime::Python312 => RuntimeFiles {
            server_file: "server.py",
            server: PYTHON_SERVER,
            modules: &[("eddy_platform.py", PYTHON_PLATFORM)],
            handler_file: "handler.py",
            dependencies_file: "requirements.txt",
            dockerfile: PYTHON_DOCKERFILE,
            libraries: &[("requirements.txt", PYTHON_REQUIREMENTS)],
            bundled_server: None,
        },
        Runtime::Python314 => RuntimeFiles {
            server_file: "server.py",
            server: PYTHON314_SERVER,
            modules: &[("eddy_platform.py", PYTHON_PLATFORM)],
            handler_file: "handler.py",
            dependencies_file: "requirements.txt",
            dockerfile: PYTHON_DOCKERFILE,
            libraries: &[("requirements.txt", PYTHON314_REQUIREMENTS)],
            bundled_server: None,
        },
    }
}

/// A key for a runtime's libraries (16 hex digits): the same pinned files (and, when the
/// install bundles it, the same server) give the same key.
pub fn libraries_key(files: &RuntimeFiles) -> String {
    let mut hasher = Sha256::new();
    for (name, contents) in files.libraries {
        hash_part(&mut hasher, name);
        hash_part(&mut hasher, contents);
    }
    if files.bundled_server.is_some() {
        hash_part(&mut hasher, files.server);
    }
    hex(&hasher.finalize()[..8])
}

/// Length-prefixed, so moving bytes from one part to the next changes the hash.
fn hash_part(hasher: &mut Sha256, part: &str) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part.as_bytes());
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The build key of a function's code (20 hex digits): equal inputs give equal keys, so
/// unchanged code is never rebuilt, locally (the build dir) or on Kubernetes (the image tag).
pub fn build_hash(runtime: Runtime, source: &str, dependencies: &str) -> String {
    let files = files(runtime);
    let mut hasher = Sha256::new();
    for part in [
        runtime.as_str(),
        files.dockerfile,
        files.server,
        source,
        dependencies,
    ]
    .into_iter()
    .chain(files.libraries.iter().map(|(_, contents)| *contents))
    {
        hash_part(&mut hasher, part);
    }
    hex(&hasher.finalize()[..10])
}
