//! Starts one test nats-server, prints its client port, and waits to be killed: the harness's
//! own test uses it to show that a killed test process takes its nats-server along.

fn main() -> anyhow::Result<()> {
    let server = eddy_testing::NatsServer::start()?;
    println!("{}", server.port());
    // Held until this process is killed; Drop never runs then, which is the point.
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    drop(server);
    Ok(())
}
