package clock

import (
	"context"
	"time"
)

// Sleep waits d on c, or until ctx ends; it reports whether the whole wait passed.
func Sleep(ctx context.Context, c Clock, d time.Duration) bool {
	timer := c.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-timer.C():
		return true
	}
}
