#!/usr/bin/env bash
# Builds a real Istio agent (pilot-agent) for the interoperability tests, from the Go module
# proxy, into a cache outside the repository, and prints the directory holding it. A warm cache
# costs nothing: the build is skipped when the binary answers `pilot-agent version`. A cold one
# costs about a minute, once.
set -euo pipefail

# istio.io/istio publishes only pseudo-versions on the proxy; this is the newest.
ISTIO_VERSION=${ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}
CACHE=${MESHID_ISTIO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshid-istio/$ISTIO_VERSION}
[[ $CACHE == /* ]] || CACHE=$PWD/$CACHE # printed for other directories; GOBIN must be absolute

answers() { [[ -x $1 ]] && "$1" version >/dev/null 2>&1; }
if answers "$CACHE/pilot-agent"; then
	echo "$CACHE"
	exit 0
fi

say() { echo "hack/istio-env.sh: $*" >&2; }
say "building pilot-agent $ISTIO_VERSION from the Go module proxy into $CACHE, once: about 2 minutes on a cold machine"
# GOFLAGS cleared: a -mod=vendor or the like of the caller would refuse a module@version build.
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=
mkdir -p "$CACHE"
# go install PKG@VERSION builds outside any module, with istio's own go.mod and replaces.
GOBIN=$CACHE go install -trimpath -ldflags "-s -w" "istio.io/istio/pilot/cmd/pilot-agent@$ISTIO_VERSION" >&2

answers "$CACHE/pilot-agent"
say "done in $SECONDS s"
echo "$CACHE"
