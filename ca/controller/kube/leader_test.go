//go:build external

package kube_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/internal/testutil"
)

// Two replicas: one leads at a time, and when it stops the other takes over.
func TestLeaderElectionHandsOver(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	clients := clientsFor(t, env.Admin)
	var running atomic.Int32 // replicas inside run at once: never more than one
	leading := make(chan string, 2)

	type replica struct {
		reg  *prometheus.Registry
		stop context.CancelFunc
	}
	replicas := map[string]*replica{}
	for _, id := range []string{"a", "b"} {
		r := &replica{reg: prometheus.NewRegistry()}
		cfg := kube.LeaderConfig{
			Clients: clients, Namespace: ns, Name: "meshid-ca", Identity: id,
			LeaseDuration: 2 * time.Second, RenewDeadline: time.Second, RetryPeriod: 100 * time.Millisecond,
			Logger: testLogger(t).With("replica", id), Registerer: r.reg,
		}
		r.stop = start(t, func(ctx context.Context) error {
			return kube.RunLeaderElected(ctx, cfg, func(ctx context.Context) error {
				if n := running.Add(1); n != 1 {
					t.Errorf("%d replicas lead at once", n)
				}
				defer running.Add(-1)
				leading <- id
				<-ctx.Done()
				return nil
			})
		})
		replicas[id] = r
	}

	first := receive(t, leading, "a leader")
	follower := map[string]string{"a": "b", "b": "a"}[first]
	gauge := func(id string) float64 { return metric(t, replicas[id].reg, "meshid_ca_leader") }
	if gauge(first) != 1 || gauge(follower) != 0 {
		t.Errorf("meshid_ca_leader: %s %g, %s %g", first, gauge(first), follower, gauge(follower))
	}
	holder := func() (string, error) {
		lease, err := clients.Coordination.Leases(ns).Get(context.Background(), "meshid-ca", metav1.GetOptions{})
		if err != nil || lease.Spec.HolderIdentity == nil {
			return "", err
		}
		return *lease.Spec.HolderIdentity, nil
	}
	if h, err := holder(); h != first {
		t.Errorf("the Lease is held by %q (%v), want %s", h, err, first)
	}

	replicas[first].stop()
	if got := receive(t, leading, "the follower taking over"); got != follower {
		t.Fatalf("%s leads after %s stopped, want %s", got, first, follower)
	}
	kubetest.Eventually(t, "the Lease held by the follower", func() error {
		if h, err := holder(); err != nil || h != follower {
			return errors.New("held by " + h)
		}
		return nil
	})
}

// Work that fails gives the Lease up, and the replica waits a lease duration on its clock before
// it tries to lead again, so that another replica may try the work first.
func TestLeaderWhoseWorkFailsWaitsALeaseDuration(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	clk := testutil.NewFakeClock(time.Now())
	cfg := kube.LeaderConfig{
		Clients: clientsFor(t, env.Admin), Namespace: ns, Name: "meshid-ca", Identity: "a",
		LeaseDuration: 2 * time.Second, RenewDeadline: time.Second, RetryPeriod: 100 * time.Millisecond,
		Clock: clk, Logger: testLogger(t),
	}
	runs := make(chan time.Time, 2)
	start(t, func(ctx context.Context) error {
		return kube.RunLeaderElected(ctx, cfg, func(context.Context) error {
			runs <- clk.Now()
			return errors.New("the work is broken")
		})
	})
	first := receive(t, runs, "a first run")
	ctx, cancel := context.WithTimeout(t.Context(), kubetest.WaitLimit)
	defer cancel()
	if err := clk.WaitForDeadline(ctx, first.Add(cfg.LeaseDuration)); err != nil {
		t.Fatalf("the replica does not wait a lease duration on its clock: %v", err)
	}
	select {
	case <-runs:
		t.Fatal("the replica led again before its clock moved")
	default:
	}
	clk.Advance(cfg.LeaseDuration)
	if again := receive(t, runs, "a run after the wait"); !again.Equal(first.Add(cfg.LeaseDuration)) {
		t.Fatalf("led again at %s, want a lease duration after the failure, at %s", again, first.Add(cfg.LeaseDuration))
	}
}

func receive[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(kubetest.WaitLimit):
		t.Fatalf("%s: not within %s", what, kubetest.WaitLimit)
		panic("unreachable")
	}
}
