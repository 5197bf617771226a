# kvmesh-cp, the control plane, as a container image (istio/base/control-plane.yaml runs it).
#   docker build -t REGISTRY/kvmesh-cp:0.1.0 .      (or podman, buildah, kaniko, ...)
# Two stages: the build needs the Rust toolchain and a C compiler (ring); the image holds
# the binary, glibc and CA certificates, and runs as an unprivileged user.
FROM docker.io/library/rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# --locked: exactly the dependency versions of Cargo.lock.
RUN cargo build --release --locked -p kvmesh-cp \
 && install -D -m 0755 target/release/kvmesh-cp /out/kvmesh-cp

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/kvmesh-cp /usr/local/bin/kvmesh-cp
# The distroless `nonroot` user; the Deployment's securityContext asks for the same ids.
USER 65532:65532
# gRPC (the filters' streams) and HTTP (admin API, /metrics, /health).
EXPOSE 18000 18001
ENTRYPOINT ["/usr/local/bin/kvmesh-cp"]
