#!/usr/bin/env bash
# Builds a real Istio agent (pilot-agent) for the interoperability tests, from the Go module
# proxy, into a cache outside the repository, and prints the directory holding it. A warm cache
# costs nothing: the build is skipped when the binary answers `pilot-agent version`. A cold one
# costs about a minute, once.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/go-tool.sh"

# istio.io/istio publishes only pseudo-versions on the proxy; this is the newest.
ISTIO_VERSION=${ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}
CACHE=${MESHID_ISTIO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshid-istio/$ISTIO_VERSION}
go_tool_cached hack/istio-env.sh pilot-agent istio.io/istio/pilot/cmd/pilot-agent \
	"$ISTIO_VERSION" "$CACHE" install "about 2 minutes" version
