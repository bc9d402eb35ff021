//! The runtime servers, shipped inside the binary. The same files build the container images
//! (`controller/runtimes/<runtime>/Dockerfile`), so local mode and Kubernetes run identical code.

use eddy_api::resources::Runtime;

/// Node.js 20 server.
pub const NODEJS20_SERVER: &str = include_str!("../runtimes/nodejs20/server.js");
/// Python 3.11 server.
pub const PYTHON311_SERVER: &str = include_str!("../runtimes/python311/server.py");

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
}

/// The files of `runtime`.
pub fn files(runtime: Runtime) -> RuntimeFiles {
    match runtime {
        Runtime::Nodejs20 => RuntimeFiles {
            server_file: "server.js",
            server: NODEJS20_SERVER,
            handler_file: "handler.js",
            dependencies_file: "package.json",
        },
        Runtime::Python311 => RuntimeFiles {
            server_file: "server.py",
            server: PYTHON311_SERVER,
            handler_file: "handler.py",
            dependencies_file: "requirements.txt",
        },
    }
}
