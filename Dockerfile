# syntax=docker/dockerfile:1
# Two images: the default target is meshid (every command); --target agent is the slim
# meshid-agent for sidecars. Both run as the distroless non-root user (65532), which owns every
# directory the default paths write to, so that neither needs root nor a mount to start.
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
