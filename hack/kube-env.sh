#!/usr/bin/env bash
# Builds a real kube-apiserver and etcd for the Kubernetes tests, from the Go module proxy (no
# release downloads are reachable here), into a cache outside the repository, and prints the
# directory holding them. A warm cache costs nothing: the build is skipped when both binaries
# answer --version. A cold one costs about seven minutes and 4 GB of Go caches, once.
# See ../shared/notes/kubernetes-test-env.md for why each step is as it is.
set -euo pipefail

KUBE_VERSION=${KUBE_VERSION:-v1.37.1} # v1.37.2 is refused by the proxy; @latest resolves older
ETCD_VERSION=${ETCD_VERSION:-v3.7.0}  # the etcd kubernetes 1.37.1 pins (hack/lib/etcd.sh)
CACHE=${MESHID_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshid-kube/$KUBE_VERSION}

answers() { [[ -x $1 ]] && "$1" --version >/dev/null 2>&1; }
if answers "$CACHE/kube-apiserver" && answers "$CACHE/etcd"; then
	echo "$CACHE"
	exit 0
fi

say() { echo "hack/kube-env.sh: $*" >&2; }
say "building kube-apiserver $KUBE_VERSION and etcd $ETCD_VERSION from the Go module proxy into $CACHE, once:"
say "on a cold machine about 9 minutes on 2 cores and 4 GB of Go caches; nothing on later runs"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$CACHE"

# kube-apiserver: kubernetes' go.mod points every k8s.io/X at ./staging; point them at the
# published modules of the same release instead (v1.37.1 → v0.37.1).
staging_version=v0.${KUBE_VERSION#v1.}
kube_mod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
mkdir "$work/kube"
{
	echo "module meshid.local/kube-build"
	echo "go 1.26"
	echo "require k8s.io/kubernetes $KUBE_VERSION"
	sed -n "s#^[[:space:]]*\(k8s.io/[^[:space:]]*\) => ./staging/src/.*#replace \1 => \1 $staging_version#p" "$kube_mod"
} >"$work/kube/go.mod"
printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/kube-apiserver"\n' >"$work/kube/tools.go"
minor=${KUBE_VERSION#v1.}
minor=${minor%%.*}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
done
say "kube-apiserver: downloading its modules"
(cd "$work/kube" && go mod tidy)
say "kube-apiserver: compiling (the longest step; $SECONDS s so far)"
(cd "$work/kube" && go build -trimpath -ldflags "$ldflags" -o "$CACHE/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver)
say "kube-apiserver built ($SECONDS s so far)"

# etcd: its server module is a main package; its own replace directives do not apply here.
mkdir "$work/etcd"
printf 'module meshid.local/etcd-build\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" >"$work/etcd/go.mod"
printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >"$work/etcd/tools.go"
say "etcd: downloading its modules and compiling"
(cd "$work/etcd" && go mod tidy && go build -trimpath -ldflags "-s -w" -o "$CACHE/etcd" go.etcd.io/etcd/server/v3)

answers "$CACHE/kube-apiserver" && answers "$CACHE/etcd"
say "done in $SECONDS s"
echo "$CACHE"
