//! `eddy`: the one binary. Service subcommands run one component each (for containers and for
//! tests that kill one component); client verbs talk to a running platform.

// glibc malloc dominated the dispatcher's profile (malloc/free ~18% of samples);
// mimalloc is made for many small short-lived allocations across threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser as _;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    eddy::run(eddy::Cli::parse()).await
}
