# The eddy image: one static-ish binary that runs the controller (kubernetes backend), the
# event-bus and the dispatcher (the chart picks the subcommand). Build from the repository root:
#   docker build -t ghcr.io/eddy-dev/eddy:0.1.0 .
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin eddy \
 && cp target/release/eddy /eddy

# glibc, and git with ssh for the controller to resolve the references of Git sources
# (git ls-remote); runs as uid 65532.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends git openssh-client ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 65532 --user-group --no-create-home --home-dir /tmp eddy
COPY --from=build /eddy /usr/local/bin/eddy
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/eddy"]
