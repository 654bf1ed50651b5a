// Package hostport checks the HOST:PORT addresses meshid's commands are given, so that a
// mistake is refused at start with a hint, instead of showing up later: an address without a
// port that gRPC dials on 443 forever, a URL whose scheme is taken for a host, a port out of
// range that fails only when the server listens.
package hostport

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// CheckDial checks an address to dial: a host (a name or an IP, an IPv6 one in brackets) and a
// numeric port from 1 to 65535, with no scheme. The error says what is wrong and, for a scheme
// or a missing port, what to give instead; the caller adds the flag's name.
func CheckDial(addr string) error { return check(addr, false) }

// CheckListen checks an address to listen on: as CheckDial, but the host may be empty (every
// interface) and the port may be 0 (the kernel picks a free one).
func CheckListen(addr string) error { return check(addr, true) }

func check(addr string, listen bool) error {
	if addr == "" {
		return errors.New("empty: give HOST:PORT")
	}
	if scheme, rest, ok := strings.Cut(addr, "://"); ok {
		rest, _, _ = strings.Cut(strings.TrimLeft(rest, "/"), "/") // dns:///host:port has an empty authority
		return fmt.Errorf("%s:// is not part of an address: give HOST:PORT, as in %q", scheme, withPort(rest))
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		var addrErr *net.AddrError
		switch {
		case errors.As(err, &addrErr) && addrErr.Err == "missing port in address":
			return fmt.Errorf("no port: give HOST:PORT, as in %q", withPort(addr))
		case errors.As(err, &addrErr) && addrErr.Err == "too many colons in address":
			return fmt.Errorf("give HOST:PORT, an IPv6 host in brackets, as in %q", withPort(addr))
		}
		return fmt.Errorf("give HOST:PORT: %w", err)
	}
	if host == "" && !listen {
		return fmt.Errorf("no host: give HOST:PORT, as in %q", net.JoinHostPort("127.0.0.1", port))
	}
	lowest := uint64(1)
	if listen {
		lowest = 0 // the kernel picks one
	}
	// Digits only: net.Dial would also take a service name ("https"), which is a port nobody meant.
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n < lowest || strings.HasPrefix(port, "+") {
		return fmt.Errorf("port %q: want a number from %d to 65535", port, lowest)
	}
	return nil
}

// withPort suggests an address for what was given: a host keeps its own port, if it had one.
func withPort(hostMaybePort string) string {
	if _, _, err := net.SplitHostPort(hostMaybePort); err == nil {
		return hostMaybePort
	}
	host := strings.TrimSuffix(strings.TrimPrefix(hostMaybePort, "["), "]")
	if host == "" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, "PORT")
}
