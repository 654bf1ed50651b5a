#!/usr/bin/env bash
# Builds the Dockerfile's three images under the user's names and, with PUSH=1, pushes them:
#
#   make images REGISTRY=registry.example.com/team TAG=v1.2.3 PUSH=1
#
# names $REGISTRY/meshid (target meshid), $REGISTRY/meshid-agent (agent) and $REGISTRY/meshid-proxy
# (proxy), each :$TAG. REGISTRY defaults to ghcr.io/meshid, TAG to VERSION (git describe), which the
# binaries report. DOCKER is the client (docker; podman takes the same commands). It prints the
# image names, one a line; hack/manifests.sh puts the same names in the Kubernetes manifests.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${VERSION:-$(git describe --tags --always --dirty 2>/dev/null || echo devel)}
REGISTRY=${REGISTRY:-ghcr.io/meshid}
TAG=${TAG:-$VERSION}
PUSH=${PUSH:-0}
read -ra docker <<<"${DOCKER:-docker}"

refuse() { echo "hack/images.sh: $*" >&2; exit 2; }
# The shapes docker accepts: a registry host (optionally :port) and lowercase path components; a
# tag of at most 128 word characters, dots and dashes, not starting with either.
[[ $REGISTRY =~ ^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$ ]] ||
	refuse "REGISTRY=$REGISTRY: want HOST[:PORT][/path], the path in lowercase"
[[ $TAG =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || refuse "TAG=$TAG: want letters, digits, _ . - (at most 128)"
[[ $VERSION =~ ^[A-Za-z0-9_.+-]+$ ]] || refuse "VERSION=$VERSION: want letters, digits, _ . + -"
[[ $PUSH == 0 || $PUSH == 1 ]] || refuse "PUSH=$PUSH: want 1 to push, 0 (the default) not to"
((${#docker[@]} > 0)) || refuse "DOCKER is empty"

images=()
for pair in meshid:meshid agent:meshid-agent proxy:meshid-proxy; do
	target=${pair%%:*}
	image=$REGISTRY/${pair#*:}:$TAG
	echo "hack/images.sh: building $image (target $target)" >&2
	"${docker[@]}" build --target "$target" --build-arg "VERSION=$VERSION" --tag "$image" .
	images+=("$image")
done
# Pushed only once all three built, so that a failed build pushes nothing.
if [[ $PUSH == 1 ]]; then
	for image in "${images[@]}"; do
		echo "hack/images.sh: pushing $image" >&2
		"${docker[@]}" push "$image"
	done
fi
printf '%s\n' "${images[@]}"
