#!/usr/bin/env bash
# Builds SPIFFE's spiffe-helper, unmodified, for the Workload API interoperability tests: it
# writes a workload's X.509-SVID, key and bundle to files and runs a command on each renewal. It
# builds from the Go module proxy into a cache outside the repository and prints the directory
# holding the binary. A warm cache costs nothing: the build is skipped when the binary answers
# `spiffe-helper -version`. A cold one costs about a minute, once.
set -euo pipefail

HELPER_VERSION=${SPIFFE_HELPER_VERSION:-v0.11.0}
CACHE=${MESHID_SPIFFE_HELPER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshid-spiffe-helper/$HELPER_VERSION}
[[ $CACHE == /* ]] || CACHE=$PWD/$CACHE # printed for other directories; GOBIN must be absolute

answers() { [[ -x $1 ]] && "$1" -version >/dev/null 2>&1; }
if answers "$CACHE/spiffe-helper"; then
	echo "$CACHE"
	exit 0
fi

say() { echo "hack/spiffe-helper-env.sh: $*" >&2; }
say "building spiffe-helper $HELPER_VERSION from the Go module proxy into $CACHE, once: about a minute on a cold machine"
# GOFLAGS cleared: a -mod=vendor or the like of the caller would refuse a module@version build.
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=
# The proxy lists no versions of github.com/spiffe/spiffe-helper, so `go install PKG@VERSION` is
# refused; a throwaway module pins the exact version as a tool dependency instead, and
# spiffe-helper's go.mod decides every other version.
mod=$CACHE/mod
rm -rf "$mod"
mkdir -p "$mod"
(
	cd "$mod"
	go mod init meshid.invalid/spiffe-helper-build >&2 2>/dev/null
	go get -tool "github.com/spiffe/spiffe-helper/cmd/spiffe-helper@$HELPER_VERSION" >&2
	GOBIN=$CACHE go install -trimpath -ldflags "-s -w" github.com/spiffe/spiffe-helper/cmd/spiffe-helper >&2
)

answers "$CACHE/spiffe-helper"
say "done in $SECONDS s"
echo "$CACHE"
