//! The runtime servers, shipped inside the binary. The same files build the container images
//! (`controller/runtimes/<runtime>/Dockerfile`), so local mode and Kubernetes run identical code.

use eddy_model::resources::Runtime;
use sha2::{Digest, Sha256};

/// Node.js 20 server.
pub const NODEJS20_SERVER: &str = include_str!("../runtimes/nodejs20/server.js");
/// Python 3.11 server.
pub const PYTHON311_SERVER: &str = include_str!("../runtimes/python311/server.py");

/// Node.js 20 image recipe.
pub const NODEJS20_DOCKERFILE: &str = include_str!("../runtimes/nodejs20/Dockerfile");
/// Python 3.11 image recipe.
pub const PYTHON311_DOCKERFILE: &str = include_str!("../runtimes/python311/Dockerfile");

/// File names and contents of one runtime.
#[derive(Debug, Clone, Copy)]
pub struct RuntimeFiles {
    /// The server's file name.
    pub server_file: &'static str,
    /// The server's code.
    pub server: &'static str,
    /// Where the user's code goes.
    pub handler_file: &'static str,
    /// Where the user's dependencies go.
    pub dependencies_file: &'static str,
    /// The container image recipe.
    pub dockerfile: &'static str,
}

/// The files of `runtime`.
pub fn files(runtime: Runtime) -> RuntimeFiles {
    match runtime {
        Runtime::Nodejs20 => RuntimeFiles {
            server_file: "server.js",
            server: NODEJS20_SERVER,
            handler_file: "handler.js",
            dependencies_file: "package.json",
            dockerfile: NODEJS20_DOCKERFILE,
        },
        Runtime::Python311 => RuntimeFiles {
            server_file: "server.py",
            server: PYTHON311_SERVER,
            handler_file: "handler.py",
            dependencies_file: "requirements.txt",
            dockerfile: PYTHON311_DOCKERFILE,
        },
    }
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
    ] {
        // Length-prefixed, so moving bytes from one part to the next changes the key.
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hasher.finalize();
    digest[..10]
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}
