//go:build !linux

package main

import "testing"

// diskContention is generated on Linux only (O_DIRECT): elsewhere the contended cases are skipped.
func diskContention(b *testing.B, _ int) (stop func()) {
	b.Helper()
	b.Skip("disk contention is generated on Linux only")
	return func() {}
}
