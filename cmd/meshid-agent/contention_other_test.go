//go:build !linux

package main

import "testing"

// contention is generated on Linux only (O_DIRECT): elsewhere the contended cases are skipped.
type contention struct{}

func diskContention(b *testing.B, _ int) *contention {
	b.Helper()
	b.Skip("disk contention is generated on Linux only")
	return nil
}

func (*contention) resume() {}
func (*contention) pause()  {}
func (*contention) stop()   {}
