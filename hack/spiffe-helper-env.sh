#!/usr/bin/env bash
# Builds SPIFFE's spiffe-helper, unmodified, for the Workload API interoperability tests: it
# writes a workload's X.509-SVID, key and bundle to files and runs a command on each renewal. It
# builds from the Go module proxy into a cache outside the repository and prints the directory
# holding the binary. A warm cache costs nothing: the build is skipped when the binary answers
# `spiffe-helper -version`. A cold one costs about a minute, once.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/go-tool.sh"

HELPER_VERSION=${SPIFFE_HELPER_VERSION:-v0.11.0}
CACHE=${MESHID_SPIFFE_HELPER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshid-spiffe-helper/$HELPER_VERSION}
go_tool_cached hack/spiffe-helper-env.sh spiffe-helper github.com/spiffe/spiffe-helper/cmd/spiffe-helper \
	"$HELPER_VERSION" "$CACHE" tool "about a minute" -version
