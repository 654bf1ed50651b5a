package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/internal/hostport"
)

// NewProbeCommand returns `probe`: exit 0 when http://ADDR/PATH answers 200, or when the
// liveness file --probe-path was updated within --interval; 1 otherwise, and 2 when its flags
// cannot work.
func NewProbeCommand() *cobra.Command {
	var (
		addr      string
		path      string
		timeout   time.Duration
		probePath string
		interval  time.Duration
	)
	cmd := &cobra.Command{
		Use:   "probe",
		Short: "Check that a running agent or CA is ready",
		Long: `Probe asks a running meshid agent (status port, :15020) or CA (monitoring port, :9093)
whether it is ready, by GET http://ADDR/healthz/ready. It exits 0 when the answer is
200 OK and 1 otherwise, printing the reason on stderr (2 when it is called wrongly: no
--addr, an address that is not HOST:PORT). Use it as an exec readiness probe.

With --probe-path FILE --interval D instead (Citadel's probe), it checks a liveness file
that "meshid ca --liveness-probe-path" keeps fresh: it exits 0 when FILE was modified
less than D ago.`,
		Args: cobra.NoArgs,
		// A probe called wrongly exits 2, not 1: a kubelet or an operator can tell "not ready"
		// from "this probe can never succeed".
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			var errs []error
			switch {
			case probePath != "" && addr != "":
				errs = append(errs, errors.New("give either --addr or --probe-path, not both"))
			case probePath != "":
				if interval <= 0 {
					errs = append(errs, errors.New("--interval must be positive with --probe-path"))
				}
			case cmd.Flags().Changed("interval"):
				errs = append(errs, errors.New("--interval needs --probe-path"))
			case addr == "":
				errs = append(errs, errors.New("--addr (or --probe-path) is required"))
			default:
				if err := hostport.CheckDial(addr); err != nil {
					errs = append(errs, fmt.Errorf("--addr %q: %w", addr, err))
				}
			}
			if timeout <= 0 {
				errs = append(errs, fmt.Errorf("--timeout %s must be positive", timeout))
			}
			return errors.Join(errs...)
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			if probePath != "" {
				return ProbeFile(probePath, interval, time.Now())
			}
			return Probe(cmd.Context(), addr, path, timeout)
		},
	}
	cmd.Flags().StringVar(&addr, "addr", "", "HOST:PORT of the status or monitoring server (required unless --probe-path)")
	cmd.Flags().StringVar(&path, "path", "/healthz/ready", "path to GET")
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Second, "give up after this long")
	cmd.Flags().StringVar(&probePath, "probe-path", "", "liveness file to check instead of --addr (meshid ca --liveness-probe-path)")
	cmd.Flags().DurationVar(&interval, "interval", 0, "with --probe-path: the file must have been modified less than this long ago")
	return cmd
}

// ProbeFile returns nil when path was modified less than interval before now, else why not.
func ProbeFile(path string, interval time.Duration, now time.Time) error {
	if interval <= 0 {
		return errors.New("--interval must be positive with --probe-path")
	}
	info, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("probe %s: %w", path, err)
	}
	if age := now.Sub(info.ModTime()); age >= interval {
		return fmt.Errorf("probe %s: last updated %s ago, at %s; want less than %s", path, age.Round(time.Second),
			info.ModTime().UTC().Format(time.RFC3339), interval)
	}
	return nil
}

// Probe returns nil when http://addr/path answers 200 within timeout, else an error saying why.
// It writes one HTTP/1.1 request on one connection and reads the answer with net/http's own
// parser: a probe of a local port needs none of http.Transport's pooling, proxies or HTTP/2,
// which would add 400 kB to every sidecar (BENCHMARKS.md, idle RSS).
func Probe(ctx context.Context, addr, path string, timeout time.Duration) error {
	if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	if timeout <= 0 {
		return errors.New("--timeout must be positive")
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	url := "http://" + addr + path
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("probe %s: %w", url, err)
	}
	req.Close = true
	resp, err := roundTrip(ctx, addr, req)
	if err != nil {
		return fmt.Errorf("probe %s: %w", url, err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("probe %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

// roundTrip sends req on a new connection to addr and reads the response head, both within
// ctx's deadline.
func roundTrip(ctx context.Context, addr string, req *http.Request) (*http.Response, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	}
	if err := req.Write(conn); err != nil {
		_ = conn.Close()
		return nil, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	resp.Body = readCloser{resp.Body, conn}
	return resp, nil
}

// readCloser closes the connection with the body.
type readCloser struct {
	io.ReadCloser
	conn net.Conn
}

func (r readCloser) Close() error {
	return errors.Join(r.ReadCloser.Close(), r.conn.Close())
}

func contextWithTimeout(cmd *cobra.Command, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(cmd.Context(), d)
}
