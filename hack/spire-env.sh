#!/usr/bin/env bash
# Builds SPIRE's agent (spire-agent), unmodified, for the Workload API interoperability tests:
# its `api fetch` and `api watch` commands are Workload API clients written by SPIFFE's
# maintainers. It builds from the Go module proxy into a cache outside the repository and prints
# the directory holding the binary. A warm cache costs nothing: the build is skipped when the
# binary answers `spire-agent --version`. A cold one costs up to 8 minutes on 2 cores, once: most
# of it fetching the modules of spire's many plugins, then the build.
set -euo pipefail

SPIRE_VERSION=${SPIRE_VERSION:-v1.13.3}
CACHE=${MESHID_SPIRE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshid-spire/$SPIRE_VERSION}
[[ $CACHE == /* ]] || CACHE=$PWD/$CACHE # printed for other directories; GOBIN must be absolute

answers() { [[ -x $1 ]] && "$1" --version >/dev/null 2>&1; }
if answers "$CACHE/spire-agent"; then
	echo "$CACHE"
	exit 0
fi

say() { echo "hack/spire-env.sh: $*" >&2; }
say "building spire-agent $SPIRE_VERSION from the Go module proxy into $CACHE, once: up to 8 minutes on a cold machine"
# GOFLAGS cleared: a -mod=vendor or the like of the caller would refuse a module@version build.
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=
# The proxy lists no versions of github.com/spiffe/spire, so `go install PKG@VERSION` is refused;
# a throwaway module pins the exact version as a tool dependency instead. Spire's go.mod decides
# every other version, as in its own build, since nothing else is required here.
mod=$CACHE/mod
rm -rf "$mod"
mkdir -p "$mod"
(
	cd "$mod"
	go mod init meshid.invalid/spire-build >&2 2>/dev/null
	go get -tool "github.com/spiffe/spire/cmd/spire-agent@$SPIRE_VERSION" >&2
	GOBIN=$CACHE go install -trimpath -ldflags "-s -w" github.com/spiffe/spire/cmd/spire-agent >&2
)

answers "$CACHE/spire-agent"
say "done in $SECONDS s"
echo "$CACHE"
