//! Builds the preload library that makes function runtimes non-dumpable
//! (`src/nondumpable.c`); the platform embeds it and writes it out where instances load it.
//! Any machine that builds eddy has the C toolchain it links with.

use std::{env, path::PathBuf, process::ExitCode};

fn main() -> ExitCode {
    println!("cargo:rerun-if-changed=src/nondumpable.c");
    let Some(out_dir) = env::var_os("OUT_DIR") else {
        eprintln!("OUT_DIR is not set: run this through cargo");
        return ExitCode::FAILURE;
    };
    let out = PathBuf::from(out_dir).join("libeddy_nondumpable.so");
    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    let status = compiler
        .to_command()
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg("src/nondumpable.c")
        .status();
    match status {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!(
                "building src/nondumpable.c with {:?}: {status}",
                compiler.path()
            );
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("cannot run the C compiler {:?}: {error}", compiler.path());
            ExitCode::FAILURE
        }
    }
}
