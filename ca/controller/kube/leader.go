package kube

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// LeaderConfig configures RunLeaderElected.
type LeaderConfig struct {
	Clients *Clients
	// The Lease is Namespace/Name; Identity names this replica in it and must be unique.
	Namespace, Name, Identity string
	// LeaseDuration, RenewDeadline and RetryPeriod tune the election; zero: client-go's usual
	// 15 s, 10 s and 2 s.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// Clock times the wait after work that failed; nil is the real clock. The election itself
	// runs on the real clock: the Lease's times are shared with the other replicas.
	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

func (c LeaderConfig) withDefaults() LeaderConfig {
	c.LeaseDuration = cmp.Or(c.LeaseDuration, 15*time.Second)
	c.RenewDeadline = cmp.Or(c.RenewDeadline, 10*time.Second)
	c.RetryPeriod = cmp.Or(c.RetryPeriod, 2*time.Second)
	return c
}

// CheckTimings checks the election's timings (zero: the defaults) as client-go will, so that a
// bad set can fail a start rather than a running CA.
func (c LeaderConfig) CheckTimings() error {
	c = c.withDefaults()
	if c.LeaseDuration <= c.RenewDeadline || float64(c.RenewDeadline) <= leaderelection.JitterFactor*float64(c.RetryPeriod) {
		return fmt.Errorf("leader election: want lease duration (%s) > renew deadline (%s) > %g × retry period (%s)",
			c.LeaseDuration, c.RenewDeadline, leaderelection.JitterFactor, c.RetryPeriod)
	}
	return nil
}

// RunLeaderElected runs run while this replica holds the Lease, with a context that ends when it
// stops holding it, and tries to lead again until ctx ends. Then, once run has returned, it
// releases the Lease, so that another replica takes over at once rather than when it expires;
// never before, so two replicas never run at once. It returns when ctx ends.
func RunLeaderElected(ctx context.Context, cfg LeaderConfig, run func(ctx context.Context) error) error {
	if cfg.Namespace == "" || cfg.Name == "" || cfg.Identity == "" {
		return errors.New("leader election needs a namespace, a name and an identity")
	}
	cfg = cfg.withDefaults()
	if err := cfg.CheckTimings(); err != nil {
		return err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With(logkey.Identity, cfg.Identity, logkey.Object, cfg.Namespace+"/"+cfg.Name)
	leading := prometheus.NewGauge(prometheus.GaugeOpts{Name: "meshid_ca_leader", Help: "1 while this replica holds the Lease and runs the secret controller."})
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(leading); err != nil {
			return err
		}
	}
	clk := clock.OrReal(cfg.Clock)
	for ctx.Err() == nil {
		failed, err := electOnce(ctx, cfg, log, leading, run)
		if err != nil {
			return err
		}
		if failed {
			// Work that fails at once would fail again: let another replica try it first.
			wait := clk.NewTimer(cfg.LeaseDuration)
			select {
			case <-ctx.Done():
			case <-wait.C():
			}
			wait.Stop()
		}
	}
	return nil
}

// electOnce runs one client-go election: until this replica has led and lost the Lease, or ctx
// ends. It returns after run has, and whether run failed.
func electOnce(ctx context.Context, cfg LeaderConfig, log *slog.Logger, leading prometheus.Gauge, run func(context.Context) error) (failed bool, err error) {
	var (
		mu       sync.Mutex
		stopping bool // ctx ended, or this election is over: lead no more
		led      bool
		running  sync.WaitGroup
	)
	// The election's own context outlives ctx until run has returned: client-go releases the
	// Lease as soon as that context ends.
	electCtx, stopElection := context.WithCancel(context.WithoutCancel(ctx))
	defer stopElection()
	stop := context.AfterFunc(ctx, func() {
		mu.Lock()
		stopping = true
		mu.Unlock()
		running.Wait()
		stopElection()
	})
	defer stop()

	elector, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock: &resourcelock.LeaseLock{
			LeaseMeta:  metav1.ObjectMeta{Namespace: cfg.Namespace, Name: cfg.Name},
			Client:     cfg.Clients.Coordination,
			LockConfig: resourcelock.ResourceLockConfig{Identity: cfg.Identity},
		},
		Name:            cfg.Name,
		LeaseDuration:   cfg.LeaseDuration,
		RenewDeadline:   cfg.RenewDeadline,
		RetryPeriod:     cfg.RetryPeriod,
		ReleaseOnCancel: true,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(leadCtx context.Context) {
				mu.Lock()
				if stopping {
					mu.Unlock()
					return
				}
				running.Add(1)
				led = true
				mu.Unlock()
				defer running.Done()
				// Work that ends on its own gives the Lease up, so that another replica may do it.
				defer stopElection()
				runCtx, cancel := context.WithCancel(leadCtx)
				defer cancel()
				defer context.AfterFunc(ctx, cancel)()
				log.Info("leading: this replica runs the secret controller")
				leading.Set(1)
				defer leading.Set(0)
				if err := run(runCtx); err != nil {
					log.Error("the leader's work failed; the Lease is given up", logkey.Error, err.Error())
					mu.Lock()
					failed = true
					mu.Unlock()
				}
			},
			OnStoppedLeading: func() {},
			OnNewLeader: func(identity string) {
				if identity != cfg.Identity {
					log.Info("another replica leads", logkey.Other, identity)
				}
			},
		},
	})
	if err != nil {
		return false, err
	}
	elector.Run(electCtx)
	// Run returns without waiting for the callback it started: one that has not begun yet must
	// not begin now, while the next election may already be won elsewhere.
	mu.Lock()
	stopping = true
	mu.Unlock()
	running.Wait()
	mu.Lock()
	defer mu.Unlock()
	switch {
	case !led:
	case ctx.Err() == nil:
		log.Warn("no longer leading; the secret controller stopped here and another replica takes over")
	default:
		log.Info("stopped leading; the Lease is released")
	}
	return failed, nil
}
