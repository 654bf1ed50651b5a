// Package cli holds what the meshid and meshid-agent binaries share: the root command with its
// logging flags, the probe and version commands, and the process entry point. It renders the
// configuration refusals of agent and controlplane, which name fields by their path in a Config,
// with each command's flags and variables (RenderConfigErrors, FieldNames).
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
)

// Globals are the flags every command has.
type Globals struct {
	LogLevel  string
	LogFormat string
	logger    *slog.Logger
}

// Logger returns the logger built from --log-level and --log-format (valid once the root
// command's PersistentPreRunE has run).
func (g *Globals) Logger() *slog.Logger {
	if g.logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return g.logger
}

// NewLogger builds a logger writing to w at level ("debug", "info", "warn", "error") in format
// ("text" or "json").
func NewLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lvl}
	switch strings.ToLower(format) {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	default:
		return nil, fmt.Errorf("--log-format %q: want text or json", format)
	}
}

// NewRoot returns a root command carrying the logging flags; logs go to the command's stderr.
func NewRoot(use, short, long string, g *Globals) *cobra.Command {
	root := &cobra.Command{
		Use:           use,
		Short:         short,
		Long:          long,
		SilenceUsage:  true,
		SilenceErrors: true,
		// Runnable, so that an unknown command is refused by Args instead of printing help.
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			logger, err := NewLogger(cmd.ErrOrStderr(), g.LogLevel, g.LogFormat)
			if err != nil {
				return err
			}
			g.logger = logger
			return nil
		},
	}
	root.CompletionOptions.HiddenDefaultCmd = true
	root.PersistentFlags().StringVar(&g.LogLevel, "log-level", "info", "log level: debug, info, warn or error")
	root.PersistentFlags().StringVar(&g.LogFormat, "log-format", "text", "log format: text or json")
	return root
}

// Main runs root with a context that ends on SIGINT or SIGTERM, prints any error to stderr, and
// returns the process exit code. A second signal ends the process at once, whatever is draining:
// every file it writes is replaced atomically, so nothing is left half-written.
func Main(root *cobra.Command) int {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(signals)
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case sig := <-signals:
			_, _ = fmt.Fprintf(root.ErrOrStderr(), "%s: %s: shutting down (send it again to stop at once)\n", root.Name(), sig)
			cancel()
		case <-done:
			return
		}
		select {
		case sig := <-signals:
			_, _ = fmt.Fprintf(root.ErrOrStderr(), "%s: %s again: stopping now\n", root.Name(), sig)
			os.Exit(128 + int(sig.(syscall.Signal)))
		case <-done:
		}
	}()
	markUsageErrors(root)
	if err := root.ExecuteContext(ctx); err != nil {
		_, _ = fmt.Fprintf(root.ErrOrStderr(), "%s: %s\n", root.Name(), err)
		return exitCode(err)
	}
	return 0
}

// exitCode is the status a command's error ends the process with: 2 for a refusal as called, the
// status of a child whose exit is the command's (Envoy's under the agent), else 1.
func exitCode(err error) int {
	var child interface{ ExitCode() int }
	switch {
	case errors.As(err, new(UsageError)):
		return ExitUsage
	case errors.As(err, &child) && child.ExitCode() > 0:
		return child.ExitCode()
	}
	return 1
}

// ExitUsage is the exit code of a command refused as it was called, as flag parsers use it;
// a failure while running exits 1.
const ExitUsage = 2

// UsageError is a command refused before it ran: a bad flag, argument or variable, or a
// configuration that cannot work (the slim agent without a CA, say).
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

// markUsageErrors makes every refusal that comes before a command runs a UsageError: flag
// parsing, argument checks and the PreRunE hooks, where the commands validate their
// configuration.
func markUsageErrors(c *cobra.Command) {
	c.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return UsageError{err} })
	if args := c.Args; args != nil {
		c.Args = func(cmd *cobra.Command, a []string) error { return usage(args(cmd, a)) }
	}
	if pre := c.PersistentPreRunE; pre != nil {
		c.PersistentPreRunE = func(cmd *cobra.Command, a []string) error { return usage(pre(cmd, a)) }
	}
	if pre := c.PreRunE; pre != nil {
		c.PreRunE = func(cmd *cobra.Command, a []string) error { return usage(pre(cmd, a)) }
	}
	for _, sub := range c.Commands() {
		markUsageErrors(sub)
	}
}

func usage(err error) error {
	if err == nil || errors.As(err, new(UsageError)) {
		return err
	}
	return UsageError{err}
}
