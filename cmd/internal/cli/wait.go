package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/hostport"
)

// Defaults of `wait`, Istio's `pilot-agent wait` ones.
const (
	defaultWaitTimeout        = 60 * time.Second
	defaultWaitPeriod         = 500 * time.Millisecond
	defaultWaitRequestTimeout = 500 * time.Millisecond
)

// NewWaitCommand returns `wait`: ask a running agent whether it is ready until it is, for a
// postStart hook or compose's depends_on; exit 0 once it is, 1 when --timeout passes first, 2
// when it cannot work.
func NewWaitCommand() *cobra.Command {
	var (
		addr, path                      string
		timeout, period, requestTimeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "wait",
		Short: "Block until a running agent is ready",
		Long: `Wait asks a running meshid agent whether it is ready (GET http://ADDR/healthz/ready on its
status port) every --period until the answer is 200 OK, and exits 0 then; it exits 1 when
--timeout passes first, printing the last reason, and 2 when it is called wrongly. Use it
where a container must not start before its sidecar is ready: a postStart hook, compose's
depends_on with a healthcheck, a systemd ExecStartPost. Istio's "pilot-agent wait" does the
same against Envoy's readiness port.`,
		Args: cobra.NoArgs,
		PreRunE: func(*cobra.Command, []string) error {
			var errs []error
			if err := hostport.CheckDial(addr); err != nil {
				errs = append(errs, fmt.Errorf("--addr %q: %w", addr, err))
			}
			for _, d := range []struct {
				flag  string
				value time.Duration
			}{{"timeout", timeout}, {"period", period}, {"request-timeout", requestTimeout}} {
				if d.value <= 0 {
					errs = append(errs, fmt.Errorf("--%s %s must be positive", d.flag, d.value))
				}
			}
			return errors.Join(errs...)
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, _ = fmt.Fprintf(cmd.ErrOrStderr(), "waiting for the agent at %s to be ready (at most %s)\n", addr, timeout)
			if err := Wait(cmd.Context(), nil, addr, path, timeout, period, requestTimeout); err != nil {
				return err
			}
			_, _ = fmt.Fprintln(cmd.ErrOrStderr(), "the agent is ready")
			return nil
		},
	}
	cmd.Flags().StringVar(&addr, "addr", "localhost:15020", "HOST:PORT of the agent's status server (--status-addr)")
	cmd.Flags().StringVar(&path, "path", "/healthz/ready", "path to GET")
	cmd.Flags().DurationVar(&timeout, "timeout", defaultWaitTimeout, "give up after this long")
	cmd.Flags().DurationVar(&period, "period", defaultWaitPeriod, "how long to wait between asks")
	cmd.Flags().DurationVar(&requestTimeout, "request-timeout", defaultWaitRequestTimeout, "how long one ask may take")
	return cmd
}

// Wait asks http://addr/path (see Probe, each ask within requestTimeout) every period on clk
// (nil: the real clock) until it answers 200, and returns nil then; when timeout passes on clk
// first, or ctx ends, it returns why, with the last answer's reason.
func Wait(ctx context.Context, clk clock.Clock, addr, path string, timeout, period, requestTimeout time.Duration) error {
	clk = clock.OrReal(clk)
	deadline := clk.NewTimer(timeout)
	defer deadline.Stop()
	for {
		err := Probe(ctx, addr, path, requestTimeout)
		if err == nil {
			return nil
		}
		next := clk.NewTimer(period)
		select {
		case <-next.C():
			continue
		case <-deadline.C():
			err = fmt.Errorf("not ready after %s: %w", timeout, err)
		case <-ctx.Done():
			err = fmt.Errorf("not ready: %w (%w)", err, ctx.Err())
		}
		next.Stop()
		return err
	}
}
