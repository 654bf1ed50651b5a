# Sourced by the hack/*-env.sh scripts that build a program of another project, unmodified, from
# the Go module proxy into a cache outside the repository, for the interoperability tests.

# go_tool_cached SCRIPT BIN PKG VERSION CACHE HOW ESTIMATE ARGS...
# prints CACHE, the directory holding BIN, once BIN answers ARGS (its version command). A warm
# cache costs nothing: the build is skipped when BIN already answers. HOW is install (`go install
# PKG@VERSION`, outside any module, with the project's own go.mod and replaces) or tool (the proxy
# lists no versions of the module, so `go install PKG@VERSION` is refused: a throwaway module pins
# the exact version as a tool dependency, and the project's go.mod decides every other version).
go_tool_cached() {
	local script=$1 bin=$2 pkg=$3 version=$4 cache=$5 how=$6 estimate=$7
	shift 7
	[[ $cache == /* ]] || cache=$PWD/$cache # printed for other directories; GOBIN must be absolute
	if [[ -x $cache/$bin ]] && "$cache/$bin" "$@" >/dev/null 2>&1; then
		echo "$cache"
		return 0
	fi
	echo "$script: building $bin $version from the Go module proxy into $cache, once: $estimate on a cold machine" >&2
	(
		# GOFLAGS cleared: a -mod=vendor or the like of the caller would refuse a module@version build.
		export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=
		mkdir -p "$cache"
		case $how in
		install)
			GOBIN=$cache go install -trimpath -ldflags "-s -w" "$pkg@$version" >&2
			;;
		tool)
			rm -rf "$cache/mod"
			mkdir -p "$cache/mod"
			cd "$cache/mod"
			go mod init "meshid.invalid/$bin-build" >&2 2>/dev/null
			go get -tool "$pkg@$version" >&2
			GOBIN=$cache go install -trimpath -ldflags "-s -w" "$pkg" >&2
			;;
		*)
			echo "$script: unknown way to build: $how" >&2
			exit 2
			;;
		esac
	)
	if ! "$cache/$bin" "$@" >/dev/null 2>&1; then
		echo "$script: $cache/$bin was built but does not answer $bin $*" >&2
		return 1
	fi
	echo "$script: done in $SECONDS s" >&2
	echo "$cache"
}
