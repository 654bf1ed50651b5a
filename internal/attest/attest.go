// Package attest tells who is calling a node agent's Unix socket and which identity the
// operator's rules give them: the kernel's credentials of the peer when it connected
// (SO_PEERCRED), what /proc says of its pid (start time, executable, groups, cgroups, and the
// Kubernetes pod and container read from them), matched against a watched rules file; and,
// when no rule matches a caller in a pod, a PodResolver the binary may supply.
package attest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/logkey"
)

// Why a caller is refused; errors.Is tells them apart in a Refusal.
var (
	// ErrPeerUnknown: the connection's peer could not be read (not a Unix connection, a pid
	// namespace this one cannot see, /proc unreadable).
	ErrPeerUnknown = errors.New("caller unknown")
	// ErrPIDReused: the pid that connected now belongs to another process.
	ErrPIDReused = errors.New("caller's pid reused by another process")
	// ErrNoRule: no rule matches the caller, and no pod of this node names it.
	ErrNoRule = errors.New("no rule matches the caller")
	// ErrPodNotFound is a PodResolver's answer for a pod UID that is not among this node's pods.
	ErrPodNotFound = errors.New("pod not found on this node")
)

// Reasons of refusals, as logged and counted.
const (
	ReasonPeerUnknown = "peer_unknown"
	ReasonPeerExited  = "peer_exited"
	ReasonPIDReused   = "pid_reused"
	ReasonNoRule      = "no_rule"
	ReasonPodNotFound = "pod_not_found"
	ReasonPodsFailed  = "pod_lookup_failed"
)

// Refusal is Identify's error: the caller is given no identity. It names the caller for a log
// line; a server maps it to PermissionDenied.
type Refusal struct {
	Reason string
	Caller Process
	Err    error
}

func (r *Refusal) Error() string {
	return fmt.Sprintf("%s: %s", r.Caller, r.Err.Error())
}

func (r *Refusal) Unwrap() error { return r.Err }

// PodResolver finds the identity of a pod of this node by its UID (on Kubernetes: the pod's
// namespace and service account, among the pods the API server has bound to this node). It
// returns an error wrapping ErrPodNotFound when no pod of this node has that UID.
type PodResolver interface {
	ResolvePod(ctx context.Context, podUID string) (Identity, error)
}

// Config configures an Attestor.
type Config struct {
	// RulesFile is the rules' YAML file, watched by Run; "" means no rules (only Pods, if set,
	// gives identities).
	RulesFile string
	// Proc is the root of the /proc tree; "": DefaultProc.
	Proc string
	// Pods, if set, is asked for a caller in a pod that no rule matches.
	Pods       PodResolver
	Clock      clock.Clock // paces the refusals' log lines and debounces the file's changes
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// Attestor identifies callers.
type Attestor struct {
	cfg     Config
	proc    ProcFS
	clock   clock.Clock
	log     *slog.Logger
	metrics *metrics
	logs    *admission.LogLimiter
	logged  *recentSet

	rules atomic.Pointer[[]Rule]
	// loadMu makes each load read and swap in one piece, so that of two loads the one that
	// read the file later is the one in force.
	loadMu sync.Mutex
	last   []byte // the file as last loaded; guarded by loadMu

	mu     sync.Mutex
	loaded chan struct{} // closed and replaced after each load of the rules file
}

// New returns an Attestor with the rules file's rules. A file that cannot be read or parsed is
// an error here (a bad rule in it is not: it is reported and skipped); Run watches the file.
func New(cfg Config) (*Attestor, error) {
	a := &Attestor{
		cfg:     cfg,
		proc:    ProcFS{Root: cfg.Proc},
		clock:   clock.OrReal(cfg.Clock),
		log:     cfg.Logger,
		metrics: newMetrics(),
		loaded:  make(chan struct{}),
		logged:  newRecentSet(maxLoggedCallers),
	}
	if a.log == nil {
		a.log = slog.New(slog.DiscardHandler)
	}
	a.logs = admission.NewLogLimiter(a.clock)
	a.rules.Store(&[]Rule{})
	if cfg.RulesFile != "" {
		if err := a.load(); err != nil {
			return nil, err
		}
	}
	if cfg.Registerer != nil {
		if err := a.metrics.register(cfg.Registerer); err != nil {
			return nil, fmt.Errorf("register attestation metrics: %w", err)
		}
	}
	return a, nil
}

// maxRulesFile bounds the rules file read.
const maxRulesFile = 1 << 20

// load reads the rules file and, if it parses, swaps its rules in. Bad rules are logged with
// their index and skipped. A file unchanged since the last load is left alone, so that its bad
// rules are reported once.
func (a *Attestor) load() error {
	a.loadMu.Lock()
	defer a.loadMu.Unlock()
	data, err := readFile(a.cfg.RulesFile, maxRulesFile)
	if err == nil && a.last != nil && bytes.Equal(data, a.last) {
		return nil // touched, or the load after the watch started: its rules are in force
	}
	if err == nil {
		var (
			rules []Rule
			bad   []BadRule
		)
		rules, bad, err = ParseRules(data)
		if err == nil {
			for _, b := range bad {
				a.metrics.badRules.Inc()
				a.log.Warn("workload attestation rule skipped", logkey.Path, a.cfg.RulesFile, logkey.Item, b.Index, logkey.Error, b.Err.Error())
			}
			a.rules.Store(&rules)
			a.last = data
			a.metrics.rules.Set(float64(len(rules)))
			a.metrics.loads.WithLabelValues("ok").Inc()
			a.log.Info("workload attestation rules loaded", logkey.Path, a.cfg.RulesFile, logkey.Kept, len(rules), logkey.Dropped, len(bad))
			return nil
		}
	}
	a.metrics.loads.WithLabelValues("error").Inc()
	return fmt.Errorf("workload attestation rules %s: %w", a.cfg.RulesFile, err)
}

func (a *Attestor) signalLoaded() {
	a.mu.Lock()
	defer a.mu.Unlock()
	close(a.loaded)
	a.loaded = make(chan struct{})
}

// Loaded returns a channel closed when Run next reloads the rules file (or fails to).
func (a *Attestor) Loaded() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.loaded
}

// Rules returns the rules in force, in the order they are tried.
func (a *Attestor) Rules() []Rule {
	return append([]Rule(nil), *a.rules.Load()...)
}

// Run watches the rules file until ctx ends, swapping in its rules on each change; a file that
// cannot be read or parsed leaves the rules in force (logged, counted).
func (a *Attestor) Run(ctx context.Context) error {
	if a.cfg.RulesFile == "" {
		<-ctx.Done()
		return nil
	}
	w, err := filewatch.New(filewatch.Config{Paths: []string{a.cfg.RulesFile}, Clock: a.clock, Logger: a.log})
	if err != nil {
		return fmt.Errorf("watch workload attestation rules: %w", err)
	}
	ready := make(chan struct{})
	go func() {
		defer close(ready)
		// A change between New's load and the watch's start would be missed: load once more
		// when the watch is in place.
		select {
		case <-w.Ready():
			a.reload()
		case <-ctx.Done():
		}
	}()
	err = w.Run(ctx, func([]string) { a.reload() })
	<-ready
	if err != nil {
		return fmt.Errorf("watch workload attestation rules: %w", err)
	}
	return nil
}

// reload loads the rules file again, keeping the rules in force if it cannot.
func (a *Attestor) reload() {
	defer a.signalLoaded() // after the log line, which a test of a failed load looks for
	if err := a.load(); err != nil {
		a.log.Error("workload attestation rules not reloaded, the previous ones are kept", logkey.Path, a.cfg.RulesFile, logkey.Error, err.Error())
	}
}

// Identify gives the caller of a gRPC call (made on a connection of Credentials) its identity,
// or a *Refusal.
func (a *Attestor) Identify(ctx context.Context) (Identity, error) {
	info, ok := authInfoFrom(ctx)
	if !ok {
		return Identity{}, a.refuse(&Refusal{Reason: ReasonPeerUnknown, Err: fmt.Errorf("%w: the connection was not attested", ErrPeerUnknown)})
	}
	return a.IdentifyProcess(ctx, info.Process, info.Err)
}

// Caller is Identify for a consumer that takes the names alone (the agent's node mode).
func (a *Attestor) Caller(ctx context.Context) (namespace, serviceAccount string, err error) {
	id, err := a.Identify(ctx)
	return id.Namespace, id.ServiceAccount, err
}

// IdentifyProcess gives p, as Attest read it (with its error), its identity, or a *Refusal.
// The pid is checked again: a process that is gone, or whose pid now names another process, is
// refused.
func (a *Attestor) IdentifyProcess(ctx context.Context, p Process, attestErr error) (Identity, error) {
	if attestErr != nil {
		return Identity{}, a.refuse(&Refusal{Reason: reasonOf(attestErr), Caller: p, Err: attestErr})
	}
	if now, err := a.proc.StartTime(p.PID); err != nil {
		return Identity{}, a.refuse(&Refusal{Reason: reasonOf(err), Caller: p, Err: err})
	} else if now != p.StartTime {
		return Identity{}, a.refuse(&Refusal{Reason: ReasonPIDReused, Caller: p,
			Err: fmt.Errorf("%w: started at tick %d at the handshake, %d now", ErrPIDReused, p.StartTime, now)})
	}
	for _, r := range *a.rules.Load() {
		if r.matches(p) {
			a.metrics.identified.WithLabelValues("rule").Inc()
			return r.identity(), nil
		}
	}
	if a.cfg.Pods != nil && p.PodUID != "" {
		id, err := a.cfg.Pods.ResolvePod(ctx, p.PodUID)
		switch {
		case errors.Is(err, ErrPodNotFound):
			return Identity{}, a.refuse(&Refusal{Reason: ReasonPodNotFound, Caller: p, Err: fmt.Errorf("pod %s: %w", p.PodUID, err)})
		case err != nil:
			return Identity{}, a.refuse(&Refusal{Reason: ReasonPodsFailed, Caller: p, Err: fmt.Errorf("look up pod %s: %w", p.PodUID, err)})
		}
		a.metrics.identified.WithLabelValues("pod").Inc()
		return id, nil
	}
	return Identity{}, a.refuse(&Refusal{Reason: ReasonNoRule, Caller: p, Err: ErrNoRule})
}

func reasonOf(err error) string {
	switch {
	case errors.Is(err, ErrPIDReused):
		return ReasonPIDReused
	case errors.Is(err, ErrProcessGone):
		return ReasonPeerExited
	default:
		return ReasonPeerUnknown
	}
}

// refuse counts r, and logs it the first time this process is refused for this reason (paced
// per reason), and returns it.
func (a *Attestor) refuse(r *Refusal) error {
	a.metrics.refusals.WithLabelValues(r.Reason).Inc()
	key := recentKey{pid: r.Caller.PID, start: r.Caller.StartTime, reason: r.Reason}
	if !a.logged.add(key) {
		return admission.Logged(r)
	}
	if ok, dropped := a.logs.Allow(r.Reason); ok {
		attrs := []any{logkey.Peer, r.Caller.String(), logkey.Reason, r.Reason, logkey.Error, r.Err.Error()}
		if dropped > 0 {
			attrs = append(attrs, logkey.Suppressed, dropped)
		}
		a.log.Warn("workload attestation refused a caller", attrs...)
	}
	// Logged here, once for each caller: the servers that refuse its calls need not again.
	return admission.Logged(r)
}
