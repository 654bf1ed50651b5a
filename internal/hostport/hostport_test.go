package hostport_test

import (
	"strings"
	"testing"

	"github.com/meshid/meshid/internal/hostport"
)

func TestCheck(t *testing.T) {
	t.Parallel()
	tests := []struct {
		addr       string
		dial       string // "" means accepted
		listen     string // "" means accepted
		bothWanted bool   // listen's error is dial's
	}{
		{addr: "127.0.0.1:15012"},
		{addr: "ca.example:15012"},
		{addr: "[::1]:15012"},
		{addr: "localhost:65535"},
		{addr: ":15020", dial: `no host: give HOST:PORT, as in "127.0.0.1:15020"`},
		{addr: "127.0.0.1:0", dial: `port "0": want a number from 1 to 65535`},
		{addr: ":0", dial: "no host"},
		{addr: "", dial: "empty: give HOST:PORT", bothWanted: true},
		{addr: "127.0.0.1", dial: `no port: give HOST:PORT, as in "127.0.0.1:PORT"`, bothWanted: true},
		{addr: "ca.example", dial: `no port: give HOST:PORT, as in "ca.example:PORT"`, bothWanted: true},
		{addr: "[::1]", dial: `no port: give HOST:PORT, as in "[::1]:PORT"`, bothWanted: true},
		{addr: "::1", dial: `an IPv6 host in brackets, as in "[::1]:PORT"`, bothWanted: true},
		{addr: "https://ca.example:15012", dial: `https:// is not part of an address: give HOST:PORT, as in "ca.example:15012"`, bothWanted: true},
		{addr: "https://ca.example/", dial: `https:// is not part of an address: give HOST:PORT, as in "ca.example:PORT"`, bothWanted: true},
		{addr: "dns:///ca.example:15012", dial: `dns:// is not part of an address: give HOST:PORT, as in "ca.example:15012"`, bothWanted: true},
		{addr: "127.0.0.1:99999", dial: `port "99999": want a number from 1 to 65535`, listen: `port "99999": want a number from 0 to 65535`},
		{addr: "127.0.0.1:65536", dial: `port "65536"`, bothWanted: true},
		{addr: "127.0.0.1:-1", dial: `port "-1"`, bothWanted: true},
		{addr: "127.0.0.1:+80", dial: `port "+80"`, bothWanted: true},
		{addr: "127.0.0.1:https", dial: `port "https"`, bothWanted: true},
		{addr: "127.0.0.1:", dial: `port ""`, bothWanted: true},
		{addr: "ca.example:15012/path", dial: `port "15012/path"`, bothWanted: true},
	}
	for _, tt := range tests {
		t.Run(tt.addr, func(t *testing.T) {
			t.Parallel()
			listen := tt.listen
			if tt.bothWanted {
				listen = tt.dial
			}
			for _, c := range []struct {
				name  string
				check func(string) error
				want  string
			}{{"CheckDial", hostport.CheckDial, tt.dial}, {"CheckListen", hostport.CheckListen, listen}} {
				err := c.check(tt.addr)
				switch {
				case c.want == "" && err != nil:
					t.Errorf("%s(%q): %v, want it accepted", c.name, tt.addr, err)
				case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
					t.Errorf("%s(%q): %v, want an error with %q", c.name, tt.addr, err, c.want)
				}
			}
		})
	}
}
