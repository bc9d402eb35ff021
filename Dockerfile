# The eddy image: one binary that runs the controller (kubernetes backend), the event-bus, the
# dispatcher and the gateway (the chart picks the subcommand). Build from the repository root:
#   docker build -t ghcr.io/eddy-dev/eddy:0.1.0 .
# Build arguments: RUST_IMAGE (the build stage's toolchain) and BASE_IMAGE (a Debian bookworm or
# newer). With a binary built beforehand, `--target prebuilt` takes ./eddy from the build
# context instead of compiling (scripts/images does this, with no registry to pull Rust from).
ARG RUST_IMAGE=rust:1-bookworm
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin eddy \
 && cp target/release/eddy /eddy

# glibc, and git with ssh for the controller to resolve the references of Git sources
# (git ls-remote); runs as uid 65532.
FROM ${BASE_IMAGE} AS base
RUN apt-get update \
 && apt-get install -y --no-install-recommends git openssh-client ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 65532 --user-group --no-create-home --home-dir /tmp eddy
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/eddy"]

FROM base AS prebuilt
COPY eddy /usr/local/bin/eddy

FROM base
COPY --from=build /eddy /usr/local/bin/eddy
