package fsutil

import (
	"context"
	"log/slog"
	"os"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// LivenessFile keeps a file's modification time fresh, every Interval on Clock, while Healthy
// says so, as Citadel's --liveness-probe-path does: a probe that finds the file older than the
// interval knows the process stopped being healthy. A failure to touch it is logged once until
// it works again.
type LivenessFile struct {
	Path     string
	Interval time.Duration
	Healthy  func() bool
	Clock    clock.Clock
	Logger   *slog.Logger
}

// Run touches the file until ctx ends.
func (p *LivenessFile) Run(ctx context.Context) error {
	failing := false // the last touch failed: logged once until it works again
	for {
		if p.Healthy() {
			err := p.touch()
			switch {
			case err != nil && !failing:
				p.Logger.Error("cannot update the liveness probe file", logkey.Path, p.Path, logkey.Error, err.Error())
			case err == nil && failing:
				p.Logger.Info("liveness probe file updated again", logkey.Path, p.Path)
			}
			failing = err != nil
		}
		if !clock.Sleep(ctx, p.Clock, p.Interval) {
			return nil
		}
	}
}

func (p *LivenessFile) touch() error {
	now := p.Clock.Now()
	if err := os.Chtimes(p.Path, now, now); err == nil {
		return nil
	}
	f, err := os.OpenFile(p.Path, os.O_CREATE|os.O_WRONLY, PrivateFileMode)
	if err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Chtimes(p.Path, now, now)
}
