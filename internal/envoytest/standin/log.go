package main

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
)

// Log attribute keys.
const (
	keyError    = "error"
	keyRetryIn  = "retry_in"
	keyType     = "type_url"
	keyVersion  = "version"
	keyName     = "name"
	keyAddress  = "address"
	keyPath     = "path"
	keyMethod   = "method"
	keyRemote   = "remote"
	keyState    = "state"
	keyTarget   = "target"
	keyGraceful = "graceful"
	keyInbound  = "inbound_only"
)

// newLogger writes to stderr at Envoy's -l level; "off" writes nothing.
func newLogger(w io.Writer, level string) *slog.Logger {
	var l slog.Level
	switch level {
	case "off":
		w = io.Discard
	case "trace", "debug":
		l = slog.LevelDebug
	case "warning", "warn":
		l = slog.LevelWarn
	case "error", "critical":
		l = slog.LevelError
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l}))
}

// logFile is --log-path: the log file, opened again on SIGUSR1 as Envoy does, so that a log
// rotator can move it away and have the next lines in a new file.
type logFile struct {
	mu   sync.Mutex
	path string
	f    *os.File
}

func openLogFile(path string) (*logFile, error) {
	l := &logFile{path: path}
	if err := l.reopen(); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *logFile) reopen() error {
	f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("log path: %w", err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f != nil {
		_ = l.f.Close()
	}
	l.f = f
	return nil
}

func (l *logFile) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.f.Write(p)
}
