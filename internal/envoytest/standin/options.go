package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime"
	"strconv"
	"strings"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	"google.golang.org/protobuf/types/known/durationpb"
)

// options are Envoy's command line options that the stand-in takes; their names and defaults are
// Envoy's (source/server/options_impl.cc).
type options struct {
	configPath               string
	configYAML               string
	mode                     string
	logFormatEscaped         bool
	skipDeprecatedLogs       bool
	useDynamicBaseID         bool
	logLevel                 string
	componentLogLevel        string
	logFormat                string
	logPath                  string
	concurrency              u32
	drainTimeS               u32
	parentShutdownTimeS      u32
	drainStrategy            string
	localAddressIPVersion    string
	disableHotRestart        bool
	allowUnknownStaticFields bool
	fileFlushIntervalMsec    u32
	serviceNode              string
	serviceCluster           string
	serviceZone              string
	adminAddressPath         string
	restartEpoch             u32
	baseID                   uint64
	help                     bool
	version                  bool
}

// logLevels are the levels Envoy's -l and --component-log-level accept.
func logLevels() []string {
	return []string{"trace", "debug", "info", "warning", "warn", "error", "critical", "off"}
}

// parseOptions reads Envoy's command line. Both the short and the long spelling of a flag are
// accepted, as TCLAP does; an error is what Envoy reports as a PARSE ERROR.
func parseOptions(args []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("envoy", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	str := func(p *string, def string, names ...string) {
		for _, n := range names {
			fs.StringVar(p, n, def, "")
		}
	}
	str(&o.configPath, "", "c", "config-path")
	str(&o.configYAML, "", "config-yaml")
	str(&o.mode, "serve", "mode")
	str(&o.logLevel, "info", "l", "log-level")
	str(&o.componentLogLevel, "", "component-log-level")
	str(&o.logFormat, "[%Y-%m-%d %T.%e][%t][%l][%n] [%g:%#] %v", "log-format")
	str(&o.logPath, "", "log-path")
	str(&o.drainStrategy, "gradual", "drain-strategy")
	str(&o.localAddressIPVersion, "v4", "local-address-ip-version")
	str(&o.serviceNode, "", "service-node")
	str(&o.serviceCluster, "", "service-cluster")
	str(&o.serviceZone, "", "service-zone")
	str(&o.adminAddressPath, "", "admin-address-path")
	o.concurrency = u32(min(runtime.NumCPU(), 1<<16)) //nolint:gosec // bounded by min
	o.drainTimeS, o.parentShutdownTimeS, o.fileFlushIntervalMsec = 600, 900, 10000
	fs.Var(&o.concurrency, "concurrency", "")
	fs.Var(&o.drainTimeS, "drain-time-s", "")
	fs.Var(&o.parentShutdownTimeS, "parent-shutdown-time-s", "")
	fs.Var(&o.fileFlushIntervalMsec, "file-flush-interval-msec", "")
	fs.Var(&o.restartEpoch, "restart-epoch", "")
	fs.Uint64Var(&o.baseID, "base-id", 0, "")
	fs.BoolVar(&o.disableHotRestart, "disable-hot-restart", false, "")
	fs.BoolVar(&o.allowUnknownStaticFields, "allow-unknown-static-fields", false, "")
	fs.BoolVar(&o.logFormatEscaped, "log-format-escaped", false, "")
	fs.BoolVar(&o.skipDeprecatedLogs, "skip-deprecated-logs", false, "")
	fs.BoolVar(&o.useDynamicBaseID, "use-dynamic-base-id", false, "")
	fs.BoolVar(&o.help, "h", false, "")
	fs.BoolVar(&o.help, "help", false, "")
	fs.BoolVar(&o.version, "version", false, "")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("couldn't find match for argument %q", fs.Arg(0))
	}
	if o.help || o.version {
		return o, nil
	}
	if !validLevel(o.logLevel) {
		return nil, fmt.Errorf("invalid log level %q: expected one of %v", o.logLevel, logLevels())
	}
	if o.componentLogLevel != "" {
		for _, pair := range strings.Split(o.componentLogLevel, ",") {
			name, level, ok := strings.Cut(pair, ":")
			if !ok || name == "" || !validLevel(level) {
				return nil, fmt.Errorf("error: component log level not correctly specified %q", pair)
			}
		}
	}
	switch o.mode {
	case "serve", "validate":
	default:
		return nil, fmt.Errorf("error: unknown mode %q: the stand-in knows serve and validate", o.mode)
	}
	switch o.drainStrategy {
	case "gradual", "immediate":
	default:
		return nil, fmt.Errorf("error: unknown drain strategy %q", o.drainStrategy)
	}
	switch o.localAddressIPVersion {
	case "v4", "v6":
	default:
		return nil, fmt.Errorf("error: unknown IP address version %q", o.localAddressIPVersion)
	}
	if o.concurrency == 0 {
		return nil, errors.New("error: concurrency must be at least 1")
	}
	return o, nil
}

// u32 is an unsigned 32-bit flag value, the width of Envoy's own options.
type u32 uint32

func (v *u32) String() string { return strconv.FormatUint(uint64(*v), 10) }

func (v *u32) Set(s string) error {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return fmt.Errorf("not an unsigned 32-bit integer: %q", s)
	}
	*v = u32(n)
	return nil
}

func validLevel(l string) bool {
	for _, v := range logLevels() {
		if l == v {
			return true
		}
	}
	return false
}

// commandLine is what /server_info reports of the options, as Envoy's toCommandLineOptions.
func (o *options) commandLine() *adminv3.CommandLineOptions {
	c := &adminv3.CommandLineOptions{
		BaseId:                   o.baseID,
		Concurrency:              uint32(o.concurrency),
		ConfigPath:               o.configPath,
		ConfigYaml:               o.configYAML,
		UseDynamicBaseId:         o.useDynamicBaseID,
		LogFormatEscaped:         o.logFormatEscaped,
		SkipDeprecatedLogs:       o.skipDeprecatedLogs,
		AllowUnknownStaticFields: o.allowUnknownStaticFields,
		AdminAddressPath:         o.adminAddressPath,
		LogLevel:                 o.logLevel,
		ComponentLogLevel:        o.componentLogLevel,
		LogFormat:                o.logFormat,
		LogPath:                  o.logPath,
		ServiceCluster:           o.serviceCluster,
		ServiceNode:              o.serviceNode,
		ServiceZone:              o.serviceZone,
		FileFlushInterval:        durationpb.New(time.Duration(o.fileFlushIntervalMsec) * time.Millisecond),
		DrainTime:                durationpb.New(time.Duration(o.drainTimeS) * time.Second),
		ParentShutdownTime:       durationpb.New(time.Duration(o.parentShutdownTimeS) * time.Second),
		DisableHotRestart:        o.disableHotRestart,
		RestartEpoch:             uint32(o.restartEpoch),
	}
	if o.mode == "validate" {
		c.Mode = adminv3.CommandLineOptions_Validate
	}
	if o.drainStrategy == "immediate" {
		c.DrainStrategy = adminv3.CommandLineOptions_Immediate
	}
	if o.localAddressIPVersion == "v6" {
		c.LocalAddressIpVersion = adminv3.CommandLineOptions_v6
	}
	return c
}

const usage = `USAGE: envoy -c <string> [--config-yaml <string>] [--mode <serve|validate>] [--concurrency <uint>] [-l <string>] [--component-log-level <string>]
  [--log-format <string>] [--log-path <string>] [--drain-time-s <uint>] [--parent-shutdown-time-s <uint>]
  [--drain-strategy <gradual|immediate>] [--local-address-ip-version <v4|v6>] [--disable-hot-restart]
  [--allow-unknown-static-fields] [--file-flush-interval-msec <uint>] [--service-node <string>]
  [--service-cluster <string>] [--service-zone <string>] [--admin-address-path <string>]
  [--restart-epoch <uint>] [--base-id <uint>] [--use-dynamic-base-id] [--log-format-escaped]
  [--skip-deprecated-logs] [--version] [-h|--help]
(the meshid test stand-in for Envoy)
`
