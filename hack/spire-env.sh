#!/usr/bin/env bash
# Builds SPIRE's agent (spire-agent), unmodified, for the Workload API interoperability tests:
# its `api fetch` and `api watch` commands are Workload API clients written by SPIFFE's
# maintainers. It builds from the Go module proxy into a cache outside the repository and prints
# the directory holding the binary. A warm cache costs nothing: the build is skipped when the
# binary answers `spire-agent --version`. A cold one costs up to 8 minutes on 2 cores, once: most
# of it fetching the modules of spire's many plugins, then the build.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/go-tool.sh"

SPIRE_VERSION=${SPIRE_VERSION:-v1.13.3}
CACHE=${MESHID_SPIRE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshid-spire/$SPIRE_VERSION}
go_tool_cached hack/spire-env.sh spire-agent github.com/spiffe/spire/cmd/spire-agent \
	"$SPIRE_VERSION" "$CACHE" tool "up to 8 minutes" --version
