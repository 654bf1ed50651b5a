#!/usr/bin/env bash
# Prints the Kubernetes manifests of each DIR (default deploy/kubernetes) with the images named as
# hack/images.sh names them, for kubectl:
#
#   make -s manifests REGISTRY=registry.example.com/team TAG=v1.2.3 | kubectl apply -f -
#   REGISTRY=... TAG=... hack/manifests.sh deploy/kubernetes/proxy | kubectl apply -f -
#
# As `kubectl apply -f DIR` reads a directory: its *.json, *.yaml and *.yml files in lexical order,
# not its subdirectories. Only the image: lines naming ghcr.io/meshid/{meshid,meshid-agent,
# meshid-proxy}:latest change. REGISTRY defaults to ghcr.io/meshid, TAG to VERSION (git describe).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${VERSION:-$(git describe --tags --always --dirty 2>/dev/null || echo devel)}
REGISTRY=${REGISTRY:-ghcr.io/meshid}
TAG=${TAG:-$VERSION}

refuse() { echo "hack/manifests.sh: $*" >&2; exit 2; }
[[ $REGISTRY =~ ^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$ ]] ||
	refuse "REGISTRY=$REGISTRY: want HOST[:PORT][/path], the path in lowercase"
[[ $TAG =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || refuse "TAG=$TAG: want letters, digits, _ . - (at most 128)"
(($# > 0)) || set -- deploy/kubernetes

first=1
for dir in "$@"; do
	[[ -d $dir ]] || refuse "$dir is not a directory"
	# kubectl walks the directory in lexical (byte) order.
	while IFS= read -r -d '' file; do
		((first)) || echo '---'
		first=0
		sed -E "s#^([[:space:]]*image:[[:space:]]*)ghcr\.io/meshid/(meshid|meshid-agent|meshid-proxy):latest[[:space:]]*\$#\1$REGISTRY/\2:$TAG#" "$file"
		# A file whose last line has no newline must not run into the separator.
		[[ -z $(tail -c1 "$file") ]] || echo
	done < <(find "$dir" -mindepth 1 -maxdepth 1 -type f \( -name '*.json' -o -name '*.yaml' -o -name '*.yml' \) -print0 | LC_ALL=C sort -z)
done
