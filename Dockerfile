# syntax=docker/dockerfile:1
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=devel
RUN CGO_ENABLED=0 go build -trimpath \
      -ldflags "-s -w -X github.com/meshid/meshid/internal/version.version=${VERSION}" \
      -o /out/meshid ./cmd/meshid \
 && mkdir -p /out/state/var/lib/meshid

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/meshid /usr/local/bin/meshid
COPY --from=build --chown=65532:65532 /out/state/var/lib/meshid /var/lib/meshid
USER 65532:65532
EXPOSE 15012 9093
ENTRYPOINT ["/usr/local/bin/meshid"]
CMD ["ca", "--state-dir", "/var/lib/meshid/ca"]
