package controlplane

import (
	"context"
	"log/slog"
	"os"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
)

// livenessProbe keeps a file's modification time fresh while the secret controller is healthy,
// as Citadel's --liveness-probe-path does; `meshid probe --probe-path` reads it.
type livenessProbe struct {
	path     string
	interval time.Duration
	healthy  func() bool
	clock    clock.Clock
	log      *slog.Logger
}

func (p *livenessProbe) run(ctx context.Context) error {
	failing := false // the last touch failed: logged once until it works again
	for {
		if p.healthy() {
			err := p.touch()
			switch {
			case err != nil && !failing:
				p.log.Error("cannot update the liveness probe file", logkey.Path, p.path, logkey.Error, err.Error())
			case err == nil && failing:
				p.log.Info("liveness probe file updated again", logkey.Path, p.path)
			}
			failing = err != nil
		}
		timer := p.clock.NewTimer(p.interval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-timer.C():
		}
	}
}

func (p *livenessProbe) touch() error {
	now := p.clock.Now()
	if err := os.Chtimes(p.path, now, now); err == nil {
		return nil
	}
	f, err := os.OpenFile(p.path, os.O_CREATE|os.O_WRONLY, fsutil.PrivateFileMode)
	if err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Chtimes(p.path, now, now)
}
