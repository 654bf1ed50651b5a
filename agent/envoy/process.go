package envoy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// Defaults of Envoy's life in the agent, as Istio's agent has them.
const (
	DefaultLogLevel          = "warning"
	DefaultComponentLogLevel = "misc:error"
	// DefaultDrainDuration is Envoy's --drain-time-s (Istio's proxyConfig drainDuration).
	DefaultDrainDuration = 45 * time.Second
	// DefaultMinimumDrainDuration and DefaultTerminationDrainDuration are Istio's
	// MINIMUM_DRAIN_DURATION and TERMINATION_DRAIN_DURATION_SECONDS.
	DefaultMinimumDrainDuration     = 5 * time.Second
	DefaultTerminationDrainDuration = 5 * time.Second
	// ActiveConnectionsInterval is how often a drain with ExitOnZeroActiveConnections asks
	// Envoy how many downstream connections are left, as Istio's agent does.
	ActiveConnectionsInterval = time.Second
	// StopGrace is how long Envoy has to exit after SIGTERM (or quitquitquit) before it is
	// killed: Envoy exits at once on either, so only a hung Envoy waits it out.
	StopGrace = 10 * time.Second
)

// Options are Envoy's command line as the agent starts it.
type Options struct {
	Path          string
	BootstrapPath string
	// ConfigYAML, when not empty, is a bootstrap (YAML or JSON) that Envoy merges over the one at
	// BootstrapPath (--config-yaml): the override, when the agent cannot merge it itself.
	ConfigYAML string
	// LogLevel and ComponentLogLevel are Envoy's -l and --component-log-level.
	LogLevel, ComponentLogLevel string
	// Concurrency is Envoy's worker threads; 0 leaves Envoy's default (one per core).
	Concurrency int
	// DrainDuration is --drain-time-s: how long Envoy's listeners drain.
	DrainDuration time.Duration
	// AdminAddressPath, when set, is where Envoy writes its admin's address
	// (--admin-address-path): for an admin on a port of the kernel's choosing.
	AdminAddressPath string
}

// Args returns Envoy's arguments, as Istio's agent passes them: the bootstrap, the drain time
// with the immediate strategy (the agent paces the drain itself), no hot restart (one Envoy per
// agent), and IPv4 local addresses.
func (o Options) Args() []string {
	args := []string{
		"-c", o.BootstrapPath,
		"--drain-time-s", strconv.Itoa(int(o.DrainDuration / time.Second)),
		"--drain-strategy", "immediate",
		"--local-address-ip-version", "v4",
		"--file-flush-interval-msec", "1000",
		"--disable-hot-restart",
		"--allow-unknown-static-fields",
		"-l", o.LogLevel,
	}
	if o.ConfigYAML != "" {
		args = append(args, "--config-yaml", o.ConfigYAML)
	}
	if o.ComponentLogLevel != "" {
		args = append(args, "--component-log-level", o.ComponentLogLevel)
	}
	if o.Concurrency > 0 {
		args = append(args, "--concurrency", strconv.Itoa(o.Concurrency))
	}
	if o.AdminAddressPath != "" {
		args = append(args, "--admin-address-path", o.AdminAddressPath)
	}
	return args
}

// DrainConfig is how the agent drains Envoy on shutdown, as Istio's agent does: it asks Envoy to
// drain its inbound listeners gracefully, waits Minimum, then, with ExitOnZeroActiveConnections,
// until Envoy's downstream connections are gone or Termination has passed since the drain
// began; without, until Termination has passed. Then it stops Envoy.
type DrainConfig struct {
	Minimum, Termination        time.Duration
	ExitOnZeroActiveConnections bool
}

// SupervisorConfig configures a Supervisor.
type SupervisorConfig struct {
	Options Options
	Drain   DrainConfig
	// Admin is Envoy's admin API, as the bootstrap has it.
	Admin *Admin
	// Signals are forwarded to Envoy as they come (SIGHUP, SIGUSR1: reopen the logs).
	Signals <-chan os.Signal
	// Stdout and Stderr receive Envoy's (default: discarded).
	Stdout, Stderr io.Writer
	Clock          clock.Clock
	Logger         *slog.Logger
}

// ExitError is Envoy's exit when it was not 0: the agent exits with Code too, so that the
// kubelet or systemd restarts the pair.
type ExitError struct {
	Code int
	// Signal is the signal that killed Envoy, if one did.
	Signal syscall.Signal
}

func (e *ExitError) Error() string {
	if e.Signal != 0 {
		return fmt.Sprintf("Envoy was killed by %v (exit status %d)", e.Signal, e.Code)
	}
	return fmt.Sprintf("Envoy exited with status %d", e.Code)
}

// ExitCode is the status the agent exits with.
func (e *ExitError) ExitCode() int { return e.Code }

// State is where Envoy is in its life under the agent.
type State int32

// States of a supervised Envoy.
const (
	NotStarted State = iota
	Running
	Draining
	Exited
)

func (s State) String() string {
	switch s {
	case NotStarted:
		return "not started"
	case Running:
		return "running"
	case Draining:
		return "draining"
	default:
		return "exited"
	}
}

// Supervisor runs Envoy as the agent's child and ends with it.
type Supervisor struct {
	cfg   SupervisorConfig
	clock clock.Clock
	log   *slog.Logger
	state atomic.Int32
	pid   atomic.Int64
	// quit is closed by Quit.
	quit     chan struct{}
	quitOnce sync.Once
}

// NewSupervisor checks cfg; it starts nothing.
func NewSupervisor(cfg SupervisorConfig) (*Supervisor, error) {
	switch {
	case cfg.Options.Path == "":
		return nil, errors.New("no Envoy binary to run")
	case cfg.Options.BootstrapPath == "":
		return nil, errors.New("no bootstrap for Envoy")
	case cfg.Admin == nil:
		return nil, errors.New("no admin address for Envoy")
	case cfg.Drain.Minimum < 0 || cfg.Drain.Termination < 0 || cfg.Options.DrainDuration < 0:
		return nil, errors.New("drain durations must not be negative")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.Stdout == nil {
		cfg.Stdout = io.Discard
	}
	if cfg.Stderr == nil {
		cfg.Stderr = io.Discard
	}
	return &Supervisor{cfg: cfg, clock: clock.OrReal(cfg.Clock), log: log, quit: make(chan struct{})}, nil
}

// State says where Envoy is.
func (s *Supervisor) State() State { return State(s.state.Load()) }

// Admin is Envoy's admin, as the supervisor reaches it.
func (s *Supervisor) Admin() *Admin { return s.cfg.Admin }

// PID is Envoy's process id while it runs, 0 before.
func (s *Supervisor) PID() int { return int(s.pid.Load()) }

// Quit ends Envoy at once, without draining (POST /quitquitquit: a Job is done); Run then
// returns Envoy's status, 0 when it obeys.
func (s *Supervisor) Quit() { s.quitOnce.Do(func() { close(s.quit) }) }

// Problem says why Envoy does not serve, for the agent's readiness: not started, draining or
// gone, or its admin /ready not LIVE. Nil when it is.
func (s *Supervisor) Problem(ctx context.Context) error {
	switch st := s.State(); st {
	case NotStarted:
		return errors.New("Envoy is not started yet: it starts once the workload certificate is in service") //nolint:staticcheck // Envoy is a name
	case Draining:
		return errors.New("Envoy is draining: the agent is shutting down") //nolint:staticcheck // Envoy is a name
	case Exited:
		return errors.New("Envoy has exited") //nolint:staticcheck // Envoy is a name
	}
	state, err := s.cfg.Admin.Ready(ctx)
	if err != nil {
		return fmt.Errorf("Envoy's admin does not answer /ready: %w", err) //nolint:staticcheck // Envoy is a name
	}
	if state != ReadyLive {
		return fmt.Errorf("Envoy is %s, not %s (admin /ready)", state, ReadyLive) //nolint:staticcheck // Envoy is a name
	}
	return nil
}

// Run starts Envoy once start is closed and supervises it until it exits, which ends Run with
// Envoy's status (nil for 0, *ExitError otherwise). When shutdown is closed it drains Envoy (see
// DrainConfig) and stops it; Quit stops it at once; so does the end of ctx (the rest of the agent
// failed). Closing shutdown before start means Envoy never starts.
func (s *Supervisor) Run(ctx context.Context, start, shutdown <-chan struct{}) error {
	select {
	case <-start:
	case <-shutdown:
		s.state.Store(int32(Exited))
		return nil
	case <-s.quit:
		s.state.Store(int32(Exited))
		return nil
	case <-ctx.Done():
		s.state.Store(int32(Exited))
		return nil
	}
	// Envoy gets SIGTERM when the thread that started it ends (Pdeathsig): this goroutine keeps
	// its thread until Envoy has exited, so that only the agent's own death does that.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmd := exec.Command(s.cfg.Options.Path, s.cfg.Options.Args()...) //nolint:gosec // the operator's Envoy binary
	cmd.Stdout, cmd.Stderr = s.cfg.Stdout, s.cfg.Stderr
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		s.state.Store(int32(Exited))
		return fmt.Errorf("start Envoy: %w", err)
	}
	s.pid.Store(int64(cmd.Process.Pid))
	s.state.Store(int32(Running))
	s.log.Info("Envoy started", logkey.PID, cmd.Process.Pid, logkey.Path, s.cfg.Options.Path, logkey.Args, cmd.Args[1:])
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	sv := &supervision{s: s, proc: cmd.Process, exited: exited}
	return sv.run(ctx, shutdown)
}

// supervision is one run of Envoy.
type supervision struct {
	s      *Supervisor
	proc   *os.Process
	exited <-chan error
	// why says, for the log, why Envoy exited: on its own unless the agent stopped it.
	why string
}

func (sv *supervision) run(ctx context.Context, shutdown <-chan struct{}) error {
	s := sv.s
	sv.why = "on its own"
	for {
		select {
		case err := <-sv.exited:
			return sv.done(err)
		case sig := <-s.cfg.Signals:
			s.log.Info("forwarding a signal to Envoy", logkey.Signal, sig.String())
			_ = sv.proc.Signal(sig)
		case <-s.quit:
			return sv.quitNow()
		case <-ctx.Done():
			sv.why = "the agent is stopping after a failure"
			return sv.stop(syscall.SIGTERM)
		case <-shutdown:
			return sv.drain(ctx)
		}
	}
}

// drain drains Envoy, then stops it; Envoy exiting, Quit or ctx cut it short.
func (sv *supervision) drain(ctx context.Context) error {
	s := sv.s
	s.state.Store(int32(Draining))
	began := s.clock.Now()
	d := s.cfg.Drain
	s.log.Info("draining Envoy", logkey.MinimumDrain, d.Minimum, logkey.TerminationDrain, d.Termination,
		logkey.ExitOnZeroActiveConnections, d.ExitOnZeroActiveConnections)
	adminCtx, cancel := context.WithTimeout(ctx, adminTimeout)
	if err := s.cfg.Admin.DrainListeners(adminCtx); err != nil {
		s.log.Warn("Envoy did not start draining; waiting the drain out anyway", logkey.Error, err)
	}
	cancel()
	sv.why = "after the drain"
	// The minimum first, in both modes; then either the connections' end or the termination.
	if err, done := sv.wait(ctx, d.Minimum); done {
		return err
	}
	if !d.ExitOnZeroActiveConnections {
		if err, done := sv.wait(ctx, began.Add(d.Termination).Sub(s.clock.Now())); done {
			return err
		}
		return sv.stop(syscall.SIGTERM)
	}
	deadline := began.Add(d.Termination)
	for {
		adminCtx, cancel := context.WithTimeout(ctx, adminTimeout)
		n, err := s.cfg.Admin.ActiveConnections(adminCtx)
		cancel()
		switch {
		case err != nil:
			s.log.Warn("cannot count Envoy's active connections; stopping it", logkey.Error, err)
			return sv.stop(syscall.SIGTERM)
		case n == 0:
			s.log.Info("Envoy has no active connections left")
			return sv.stop(syscall.SIGTERM)
		}
		left := deadline.Sub(s.clock.Now())
		if left <= 0 {
			s.log.Info("the termination drain is over with connections left", logkey.Connections, n)
			return sv.stop(syscall.SIGTERM)
		}
		s.log.Info("Envoy still has active connections", logkey.Connections, n)
		if err, done := sv.wait(ctx, min(ActiveConnectionsInterval, left)); done {
			return err
		}
	}
}

// wait waits d, unless Envoy exits, Quit is called or ctx ends first: then done, with what
// ends the run.
func (sv *supervision) wait(ctx context.Context, d time.Duration) (_ error, done bool) {
	if d <= 0 {
		return nil, false
	}
	t := sv.s.clock.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-t.C():
			return nil, false
		case err := <-sv.exited:
			sv.why = "while draining"
			return sv.done(err), true
		case sig := <-sv.s.cfg.Signals:
			_ = sv.proc.Signal(sig)
		case <-sv.s.quit:
			return sv.quitNow(), true
		case <-ctx.Done():
			sv.why = "the agent is stopping after a failure"
			return sv.stop(syscall.SIGTERM), true
		}
	}
}

// quitNow asks Envoy to quit through its admin, as /quitquitquit does; SIGTERM if it does not
// answer.
func (sv *supervision) quitNow() error {
	s := sv.s
	s.state.Store(int32(Draining))
	sv.why = "after /quitquitquit"
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()
	if err := s.cfg.Admin.Quit(ctx); err != nil {
		s.log.Warn("Envoy's admin did not take /quitquitquit; sending SIGTERM", logkey.Error, err)
		return sv.stop(syscall.SIGTERM)
	}
	return sv.stop(0)
}

// stop sends sig (none when 0) and waits StopGrace for Envoy to exit, then kills it.
func (sv *supervision) stop(sig syscall.Signal) error {
	s := sv.s
	s.state.Store(int32(Draining))
	if sig != 0 {
		if sv.why == "on its own" {
			sv.why = "after the agent stopped it"
		}
		_ = sv.proc.Signal(sig)
	}
	t := s.clock.NewTimer(StopGrace)
	defer t.Stop()
	select {
	case err := <-sv.exited:
		return sv.done(err)
	case <-t.C():
		s.log.Error("Envoy did not exit; killing it", logkey.Grace, StopGrace)
		_ = sv.proc.Kill()
		sv.why = "killed by the agent"
		return sv.done(<-sv.exited)
	}
}

// done logs Envoy's exit and returns what the agent exits with.
func (sv *supervision) done(waitErr error) error {
	s := sv.s
	s.state.Store(int32(Exited))
	s.pid.Store(0)
	var exit *exec.ExitError
	switch {
	case waitErr == nil:
		s.log.Info("Envoy exited", logkey.Status, 0, logkey.Reason, sv.why)
		return nil
	case errors.As(waitErr, &exit):
		e := &ExitError{Code: exit.ExitCode()}
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			e.Signal = ws.Signal()
			e.Code = 128 + int(e.Signal)
		}
		s.log.Error("Envoy exited", logkey.Status, e.Code, logkey.Signal, signalName(e.Signal), logkey.Reason, sv.why)
		return e
	default:
		s.log.Error("lost Envoy", logkey.Error, waitErr)
		return fmt.Errorf("wait for Envoy: %w", waitErr)
	}
}

func signalName(sig syscall.Signal) string {
	if sig == 0 {
		return ""
	}
	return sig.String()
}
