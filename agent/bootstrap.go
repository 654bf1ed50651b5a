package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"

	"github.com/meshid/meshid/agent/envoy"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/sds"
)

// DefaultInstanceIP is the node's address when INSTANCE_IP is not given.
const DefaultInstanceIP = "127.0.0.1"

// EnvoyBootstrap is Envoy's configuration as the agent gives it.
type EnvoyBootstrap struct {
	// Bootstrap is the bootstrap file's content (envoy -c), JSON.
	Bootstrap []byte
	// Override is the bootstrap override's text, as the file holds it, when the agent has no
	// Envoy.CheckBootstrap to merge it: Envoy merges it itself (--config-yaml). Empty when there
	// is none, or when it is merged into Bootstrap.
	Override []byte
}

// maxConfigYAML is the longest override Envoy can be given on its command line: Linux refuses to
// exec an argument of MAX_ARG_STRLEN (128 KiB, its NUL included) or more.
const maxConfigYAML = 128<<10 - 1

// Bootstrap returns the bootstrap of the Envoy this agent serves, as JSON: SDS on the agent's
// SDS socket, ADS on its XDS socket (when it proxies xDS), the node as Istio derives it, and cfg's
// admin and stats ports. The sockets are where an agent run with cfg listens. cfg has been
// validated. With cfg.Envoy.CheckBootstrap, the bootstrap is checked with Envoy's types and the
// override merged over it; without, the override is returned apart, for Envoy to merge. A bad
// override is a *FieldError of Envoy.BootstrapOverride that wraps ErrConfigRefused.
func Bootstrap(ctx context.Context, cfg Config) (EnvoyBootstrap, error) {
	id, err := cfg.SPIFFEID()
	if err != nil {
		return EnvoyBootstrap{}, configerr.Errorf("Identity.TrustDomain", "workload identity ({Identity.TrustDomain}, {Identity.Namespace}, {Identity.ServiceAccount}): %w", err)
	}
	w := envoy.Workload{
		InstanceIP:     cfg.Identity.InstanceIP,
		PodName:        cfg.Identity.PodName,
		Namespace:      id.Namespace,
		ServiceAccount: id.ServiceAccount,
		ClusterID:      cfg.CA.ClusterID,
		Meta:           cfg.Envoy.Metadata,
	}
	if w.InstanceIP == "" {
		w.InstanceIP = DefaultInstanceIP
	}
	if w.PodName == "" {
		if w.PodName, err = os.Hostname(); err != nil {
			return EnvoyBootstrap{}, configerr.Errorf("Identity.PodName", "{Identity.PodName} is not given and the host's name is unknown: %w", err)
		}
	}
	bc := envoy.BootstrapConfig{
		Node:           envoy.SidecarNode(w),
		AdminPort:      cfg.Envoy.AdminPort,
		PrometheusPort: cfg.Envoy.PrometheusPort,
	}
	// Envoy may run in another directory than the agent: its paths are absolute.
	if bc.SDSSocket, err = filepath.Abs(filepath.Join(cfg.socketDir(), sds.SocketName)); err != nil {
		return EnvoyBootstrap{}, &FieldError{Field: "SDS.SocketDir", Err: err}
	}
	if cfg.XDS.Proxy {
		if bc.XDSSocket, err = filepath.Abs(cfg.xdsSocket()); err != nil {
			return EnvoyBootstrap{}, &FieldError{Field: "XDS.Socket", Err: err}
		}
	}
	var override []byte
	path := cfg.Envoy.BootstrapOverride
	if path != "" {
		if override, err = readOverride(ctx, path); err != nil {
			return EnvoyBootstrap{}, refused{&FieldError{Field: "Envoy.BootstrapOverride", Value: path, Err: err}}
		}
	}
	base, err := envoy.Bootstrap(bc)
	if err != nil {
		return EnvoyBootstrap{}, err
	}
	check := cfg.Envoy.CheckBootstrap
	if check == nil {
		if err := checkConfigYAML(override); err != nil {
			return EnvoyBootstrap{}, refused{&FieldError{Field: "Envoy.BootstrapOverride", Value: path, Err: err}}
		}
		return EnvoyBootstrap{Bootstrap: base, Override: override}, nil
	}
	merged, err := check(base, override, path)
	if errors.Is(err, envoy.ErrOverride) {
		return EnvoyBootstrap{}, refused{&FieldError{Field: "Envoy.BootstrapOverride", Err: err}}
	}
	if err != nil {
		return EnvoyBootstrap{}, fmt.Errorf("check the bootstrap: %w", err)
	}
	return EnvoyBootstrap{Bootstrap: merged}, nil
}

// checkConfigYAML refuses an override that Envoy cannot be given as its --config-yaml argument.
// Envoy parses and checks the rest when it starts.
func checkConfigYAML(override []byte) error {
	switch {
	case len(override) > maxConfigYAML:
		return fmt.Errorf("is %d bytes: Envoy is given the override on its command line (--config-yaml), which takes at most %d; meshid, which merges it into the bootstrap file, takes up to %d", len(override), maxConfigYAML, maxOverrideSize)
	case bytes.IndexByte(override, 0) >= 0:
		return errors.New("holds a NUL byte, which a command line (--config-yaml) cannot carry")
	}
	return nil
}

// readOverride reads the override file, a regular file of at most maxOverrideSize, giving up
// after fsutil's bound: it may be on a mount that stopped answering.
func readOverride(ctx context.Context, path string) ([]byte, error) {
	reads := fsutil.NewBoundedReads(nil, fsutil.DefaultReadBound, 1)
	return reads.Read(ctx, path, "the bootstrap override", func() ([]byte, error) {
		// O_NONBLOCK: opening a FIFO does not wait for a writer.
		f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
		if err != nil {
			return nil, fmt.Errorf("cannot be read: %w", err)
		}
		defer func() { _ = f.Close() }()
		if err := checkOpened(f); err != nil {
			return nil, err
		}
		data, err := io.ReadAll(io.LimitReader(f, maxOverrideSize+1))
		if err != nil {
			return nil, fmt.Errorf("cannot be read: %w", err)
		}
		if len(data) > maxOverrideSize {
			return nil, errOverrideLarge
		}
		return data, nil
	})
}

// checkOpened refuses what is not a regular file, or too large, as it was opened.
func checkOpened(f *os.File) error {
	info, err := f.Stat()
	switch {
	case err != nil:
		return fmt.Errorf("cannot be read: %w", err)
	case !info.Mode().IsRegular():
		return fmt.Errorf("is not a regular file (%s)", info.Mode().Type())
	case info.Size() > maxOverrideSize:
		return errOverrideLarge
	}
	return nil
}
