#!/usr/bin/env bash
# Regenerates the Go stubs of the protocols meshid defines itself (internal/meshcapb, internal/jwtsvidpb) with protoc
# (Debian: apt-get install protobuf-compiler) and the Go plugins at the versions go.mod pins.
set -euo pipefail
cd "$(dirname "$0")/.."

PROTOC_GEN_GO_VERSION=$(go list -m -f '{{.Version}}' google.golang.org/protobuf)
# protoc-gen-go-grpc is versioned on its own; v1.6 emits the code grpc ≥ 1.64 supports.
PROTOC_GEN_GO_GRPC_VERSION=${PROTOC_GEN_GO_GRPC_VERSION:-v1.6.2}

bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
GOBIN=$bin go install "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO_VERSION"
GOBIN=$bin go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC_VERSION"

PATH=$bin:$PATH protoc -I . \
	--go_out=. --go_opt=module=github.com/meshid/meshid \
	--go-grpc_out=. --go-grpc_opt=module=github.com/meshid/meshid \
	internal/meshcapb/meshca.proto internal/jwtsvidpb/jwtsvid.proto
