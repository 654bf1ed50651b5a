# syntax=docker/dockerfile:1
# Three images: the default target is meshid (every command); --target agent is the slim
# meshid-agent for sidecars beside an Envoy container; --target proxy is Envoy's own image with
# meshid-agent as its entrypoint, which starts Envoy itself (Istio's one-container proxy). Each runs
# as its base image's non-root user (65532 on distroless, envoy on Envoy's), which owns every
# directory the default paths write to, so that none needs root nor a mount to start.
# hack/images.sh (make images) builds and pushes all three under the user's names.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=devel
RUN for cmd in meshid meshid-agent; do \
      CGO_ENABLED=0 go build -trimpath -tags grpcnotrace \
        -ldflags "-s -w -X github.com/meshid/meshid/internal/version.version=${VERSION}" \
        -o /out/$cmd ./cmd/$cmd || exit 1; \
    done \
 && mkdir -p /out/root/var/lib/meshid /out/root/var/run/secrets/workload-spiffe-uds /out/root/etc/istio/proxy \
      /out/root/var/run/secrets/tokens

FROM gcr.io/distroless/static-debian12:nonroot AS agent
COPY --from=build /out/meshid-agent /usr/local/bin/meshid-agent
# The SDS socket's directory (an emptyDir shared with Envoy in Kubernetes).
COPY --from=build --chown=65532:65532 /out/root/var/run/secrets/workload-spiffe-uds /var/run/secrets/workload-spiffe-uds
# The XDS socket's directory (Istio mounts an emptyDir there, shared with Envoy).
COPY --from=build --chown=65532:65532 /out/root/etc/istio/proxy /etc/istio/proxy
USER 65532:65532
EXPOSE 15020
ENTRYPOINT ["/usr/local/bin/meshid-agent", "agent"]

# Envoy's official image, Ubuntu with a non-root user envoy; its entrypoint (which drops from root
# to that user) is replaced: the agent runs as envoy from the start and runs Envoy as its child,
# writing the bootstrap to /etc/istio/proxy and serving SDS and XDS there and in the socket dir.
FROM envoyproxy/envoy:v1.39.6 AS proxy
COPY --from=build /out/meshid-agent /usr/local/bin/meshid-agent
COPY --from=build --chown=envoy:envoy /out/root/var/run/secrets/workload-spiffe-uds /var/run/secrets/workload-spiffe-uds
COPY --from=build --chown=envoy:envoy /out/root/etc/istio/proxy /etc/istio/proxy
USER envoy
# 15020: the agent's status port (readiness, merged metrics, app probes); 15090: Envoy's stats.
EXPOSE 15020 15090
# Setting ENTRYPOINT drops the base image's CMD (envoy -c /etc/envoy/envoy.yaml): the agent
# writes Envoy's bootstrap and command line itself.
ENTRYPOINT ["/usr/local/bin/meshid-agent", "agent", "--envoy-path", "/usr/local/bin/envoy"]

FROM gcr.io/distroless/static-debian12:nonroot AS meshid
COPY --from=build /out/meshid /usr/local/bin/meshid
# The CA's state (its key) and the embedded control plane's, kept across containers.
COPY --from=build --chown=65532:65532 /out/root/var/lib/meshid /var/lib/meshid
COPY --from=build --chown=65532:65532 /out/root/var/run/secrets/workload-spiffe-uds /var/run/secrets/workload-spiffe-uds
COPY --from=build --chown=65532:65532 /out/root/etc/istio/proxy /etc/istio/proxy
# Where `meshid token -o` writes in the compose demo: a volume mounted here starts out owned by the
# non-root user.
COPY --from=build --chown=65532:65532 /out/root/var/run/secrets/tokens /var/run/secrets/tokens
VOLUME /var/lib/meshid
USER 65532:65532
EXPOSE 15012 9093
ENTRYPOINT ["/usr/local/bin/meshid"]
CMD ["ca", "--state-dir", "/var/lib/meshid/ca"]
