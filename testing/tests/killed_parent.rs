//! A test process killed outright (a timeout, an abort: no Drop runs) takes its nats-server
//! along: the harness starts each one in its own process group with a parent-death signal.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::BufRead as _,
    net::TcpStream,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

#[test]
fn a_killed_test_process_leaves_no_nats_server_behind() {
    // The killed process cannot remove its server's store: it goes in here, removed with it.
    let scratch = tempfile::tempdir().unwrap();
    let mut holder = Command::new(env!("CARGO_BIN_EXE_eddy-test-nats"))
        .env("TMPDIR", scratch.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line.trim().parse().unwrap();
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "the server runs"
    );
    holder.kill().unwrap();
    holder.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the nats-server of a killed test process still answers on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
