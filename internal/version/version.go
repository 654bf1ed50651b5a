// Package version reports the build version of the binaries.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// version is set at link time: -ldflags "-X github.com/meshid/meshid/internal/version.version=v1.2.3".
var version = "" // written only by the linker

// Version returns the link-time version, else the module version, else "devel".
func Version() string {
	if version != "" {
		return version
	}
	if info, ok := debug.ReadBuildInfo(); ok && info.Main.Version != "" && info.Main.Version != "(devel)" {
		return info.Main.Version
	}
	return "devel"
}

// String returns one line describing the build.
func String() string {
	return fmt.Sprintf("meshid %s (%s, %s/%s)", Version(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
