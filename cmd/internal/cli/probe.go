package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// NewProbeCommand returns `probe`: exit 0 when http://ADDR/PATH answers 200, 1 otherwise.
func NewProbeCommand() *cobra.Command {
	var (
		addr    string
		path    string
		timeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "probe",
		Short: "Check that a running agent or CA is ready",
		Long: `Probe asks a running meshid agent (status port, :15020) or CA (monitoring port, :9093)
whether it is ready, by GET http://ADDR/healthz/ready. It exits 0 when the answer is
200 OK and 1 otherwise, printing the reason on stderr. Use it as an exec readiness probe.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return Probe(cmd.Context(), addr, path, timeout)
		},
	}
	cmd.Flags().StringVar(&addr, "addr", "", "HOST:PORT of the status or monitoring server (required)")
	cmd.Flags().StringVar(&path, "path", "/healthz/ready", "path to GET")
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Second, "give up after this long")
	_ = cmd.MarkFlagRequired("addr")
	return cmd
}

// Probe returns nil when http://addr/path answers 200 within timeout, else an error saying why.
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
	// A probe talks to a local port: never through HTTP_PROXY.
	client := &http.Client{Transport: &http.Transport{Proxy: nil}}
	resp, err := client.Do(req)
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

func contextWithTimeout(cmd *cobra.Command, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(cmd.Context(), d)
}
