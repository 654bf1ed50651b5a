package envoy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/meshid/meshid/internal/localhttp"
)

// ReadyLive is what Envoy's admin /ready answers once Envoy serves.
const ReadyLive = "LIVE"

// adminTimeout bounds one request to Envoy's admin: it is local and answers at once.
const adminTimeout = 2 * time.Second

// maxAdminBody bounds what is read of an answer of the admin: /stats filtered to a few names.
const maxAdminBody = 4 << 20

// maxAddressFile bounds the read of Envoy's admin address file: one HOST:PORT.
const maxAddressFile = 512

// Admin is the client of Envoy's admin API on loopback, as the agent uses it.
type Admin struct {
	// addressFile, when set, is where Envoy writes the address its admin bound
	// (--admin-address-path): the admin listens on a port of the kernel's choosing. addr is
	// what was read there, or the fixed address.
	addressFile string
	mu          sync.Mutex
	addr        string
	// ignored are the listener stat prefixes whose connections are not the workload's: the
	// admin's own and the Prometheus stats listener's.
	ignored []string
}

// NewAdmin returns the client of the admin at addr (HOST:PORT); the connections of the listener
// on prometheusPort (the bootstrap's stats listener; 0: none) are not counted as the workload's.
func NewAdmin(addr string, prometheusPort int) *Admin {
	ignored := []string{"listener.admin."}
	if prometheusPort > 0 {
		ignored = append(ignored, "listener.0.0.0.0_"+strconv.Itoa(prometheusPort)+".")
	}
	return &Admin{addr: addr, ignored: ignored}
}

// NewAdminAt returns the client of an admin on a port of the kernel's choosing, whose address
// Envoy writes to addressFile once it listens (Options.AdminAddressPath).
func NewAdminAt(addressFile string) *Admin {
	return &Admin{addressFile: addressFile, ignored: []string{"listener.admin."}}
}

// Addr is the admin's address; with an address file, an error until Envoy has written it.
func (a *Admin) Addr() (string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.addr != "" {
		return a.addr, nil
	}
	data, err := readSmall(a.addressFile)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("Envoy has not written its admin's address to %s yet", a.addressFile) //nolint:staticcheck // Envoy is a name
	}
	if err != nil {
		return "", fmt.Errorf("read Envoy's admin address: %w", err)
	}
	addr := strings.TrimSpace(string(data))
	if _, _, err := net.SplitHostPort(addr); err != nil {
		// Envoy writes the file whole, but not atomically: a half-written one is read again.
		return "", fmt.Errorf("the admin address file %s holds %q: %w", a.addressFile, addr, err)
	}
	a.addr = addr
	return addr, nil
}

// Ready returns Envoy's state as /ready says it: ReadyLive, or PRE_INITIALIZING, INITIALIZING,
// DRAINING.
func (a *Admin) Ready(ctx context.Context) (string, error) {
	code, body, err := a.do(ctx, http.MethodGet, "/ready")
	if err != nil {
		return "", err
	}
	state := strings.TrimSpace(body)
	if code != http.StatusOK && code != http.StatusServiceUnavailable {
		return "", fmt.Errorf("/ready answered %d %s", code, state)
	}
	return state, nil
}

// DrainListeners asks Envoy to drain its inbound listeners gracefully, as Istio's agent does at
// termination: they stop taking connections and tell those they have to close.
func (a *Admin) DrainListeners(ctx context.Context) error {
	return a.post(ctx, "/drain_listeners?graceful&inboundonly")
}

// Quit asks Envoy to exit (/quitquitquit).
func (a *Admin) Quit(ctx context.Context) error { return a.post(ctx, "/quitquitquit") }

// ActiveConnections returns the workload's downstream connections Envoy holds: the sum of its
// listeners' downstream_cx_active but the admin's and the stats listener's.
func (a *Admin) ActiveConnections(ctx context.Context) (int, error) {
	code, body, err := a.do(ctx, http.MethodGet, "/stats?usedonly&filter=downstream_cx_active$")
	if err != nil {
		return 0, err
	}
	if code != http.StatusOK {
		return 0, fmt.Errorf("/stats answered %d", code)
	}
	total := 0
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), ":")
		if !ok || !strings.HasPrefix(name, "listener.") || a.isIgnored(name) {
			continue
		}
		n, err := strconv.Atoi(strings.TrimSpace(value))
		if err != nil {
			return 0, fmt.Errorf("/stats: %s: %w", name, err)
		}
		total += n
	}
	return total, sc.Err()
}

func (a *Admin) isIgnored(stat string) bool {
	for _, p := range a.ignored {
		if strings.HasPrefix(stat, p) {
			return true
		}
	}
	return false
}

func (a *Admin) post(ctx context.Context, path string) error {
	code, body, err := a.do(ctx, http.MethodPost, path)
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		return fmt.Errorf("%s answered %d %s", path, code, strings.TrimSpace(body))
	}
	return nil
}

func (a *Admin) do(ctx context.Context, method, path string) (int, string, error) {
	addr, err := a.Addr()
	if err != nil {
		return 0, "", err
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://"+addr+path, nil)
	if err != nil {
		return 0, "", err
	}
	var code int
	var body []byte
	err = localhttp.Do(req, maxAdminBody, func(r *http.Response) error {
		code = r.StatusCode
		var err error
		body, err = io.ReadAll(r.Body)
		return err
	})
	var opErr *net.OpError
	if errors.As(err, &opErr) && opErr.Op == "dial" {
		return 0, "", fmt.Errorf("Envoy's admin at %s does not accept connections: %w", addr, err) //nolint:staticcheck // Envoy is a name
	}
	return code, string(body), err
}

// readSmall reads at most maxAddressFile bytes of path: the file is Envoy's, one line long.
func readSmall(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	return io.ReadAll(io.LimitReader(f, maxAddressFile))
}
