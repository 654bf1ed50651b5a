// Command standin behaves towards the meshid agent as Envoy does, for tests where no Envoy can be
// installed: it takes Envoy's command line and bootstrap, its configuration over ADS and its
// certificates over SDS, binds the listeners it is given, serves the admin endpoints the agent
// uses, and exits on the signals Envoy exits on.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	// Caught from the start, so that a SIGTERM sent while starting ends the process as one sent
	// later does.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGUSR1, syscall.SIGHUP)
	defer signal.Stop(sigs)

	opts, err := parseOptions(args)
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "PARSE ERROR: %v\n\n%s", err, usage)
		return 1
	}
	if opts.help {
		_, _ = fmt.Fprint(stdout, usage)
		return 0
	}
	if opts.version {
		_, _ = fmt.Fprintf(stdout, "\nenvoy  version: %s\n\n", version)
		return 0
	}
	var file *logFile
	if opts.logPath != "" {
		if file, err = openLogFile(opts.logPath); err != nil {
			_, _ = fmt.Fprintln(stderr, err)
			return 1
		}
		stderr = file
	}
	log := newLogger(stderr, opts.logLevel)
	boot, err := loadBootstrap(opts.configPath, opts.configYAML, opts.allowUnknownStaticFields)
	if err != nil {
		log.Error("error initializing configuration", keyPath, opts.configPath, keyError, err)
		return 1
	}
	if opts.mode == "validate" {
		_, _ = fmt.Fprintf(stdout, "configuration '%s' OK\n", opts.configPath)
		return 0
	}
	log.Info("initializing epoch 0", "concurrency", opts.concurrency, "drain_time_s", opts.drainTimeS, "drain_strategy", opts.drainStrategy)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := newServer(log, opts, boot)
	errc := make(chan error, 1)
	go func() { errc <- srv.Run(ctx) }()
	for {
		select {
		case sig := <-sigs:
			switch sig {
			case syscall.SIGTERM, syscall.SIGINT:
				log.Info("caught " + signalName(sig))
				cancel()
				if err := <-errc; err != nil {
					log.Error("exiting", keyError, err)
					return 1
				}
				log.Info("exiting")
				return 0
			case syscall.SIGUSR1:
				if file != nil {
					if err := file.reopen(); err != nil {
						log.Error("cannot reopen the log file", keyError, err)
						continue
					}
				}
				log.Info("caught SIGUSR1: reopening logs")
			default:
				log.Info("caught SIGHUP: ignored")
			}
		case err := <-errc:
			if err != nil {
				log.Error("exiting", keyError, err)
				return 1
			}
			log.Info("exiting")
			return 0
		}
	}
}

func signalName(sig os.Signal) string {
	if sig == syscall.SIGINT {
		return "SIGINT"
	}
	return "SIGTERM"
}
