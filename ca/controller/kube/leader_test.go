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
	eventually(t, "the Lease held by the follower", func() error {
		if h, err := holder(); err != nil || h != follower {
			return errors.New("held by " + h)
		}
		return nil
	})
}

func receive[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitLimit):
		t.Fatalf("%s: not within %s", what, waitLimit)
		panic("unreachable")
	}
}
