package testutil

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// H2Conn speaks raw HTTP/2 frames to a server on a Unix socket, to see what a gRPC client hides:
// the settings the server advertises and how it answers a misbehaving peer.
type H2Conn struct {
	net.Conn
}

// HTTP/2 (RFC 9113) frame types, settings and error codes used here.
const (
	H2FrameSettings               = 0x4
	H2FramePing                   = 0x6
	H2FrameGoAway                 = 0x7
	H2SettingMaxConcurrentStreams = 0x3
	H2ErrEnhanceYourCalm          = 0xb
)

// H2Dial connects to the Unix socket and sends the client preface and empty settings.
func H2Dial(t testing.TB, socket string) *H2Conn {
	t.Helper()
	conn, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	// The deadline only bounds a broken test.
	if err := conn.SetDeadline(time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	c := &H2Conn{Conn: conn}
	if _, err := io.WriteString(conn, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	c.Write(t, H2FrameSettings, 0, nil)
	return c
}

// Write sends a frame on stream 0.
func (c *H2Conn) Write(t testing.TB, typ, flags byte, payload []byte) {
	t.Helper()
	if len(payload) >= 1<<24 {
		t.Fatalf("an HTTP/2 frame carries less than 16 MiB, not %d bytes", len(payload))
	}
	frame := make([]byte, 9, 9+len(payload))
	n := uint32(len(payload)) //nolint:gosec // checked above: under 2^24
	frame[0], frame[1], frame[2] = byte(n>>16), byte(n>>8), byte(n)
	frame[3], frame[4] = typ, flags
	if _, err := c.Conn.Write(append(frame, payload...)); err != nil {
		t.Fatal(err)
	}
}

// read returns the next frame; io.EOF once the server has closed the connection.
func (c *H2Conn) read() (typ, flags byte, payload []byte, err error) {
	var header [9]byte
	if _, err := io.ReadFull(c.Conn, header[:]); err != nil {
		return 0, 0, nil, err
	}
	payload = make([]byte, int(header[0])<<16|int(header[1])<<8|int(header[2]))
	if _, err := io.ReadFull(c.Conn, payload); err != nil {
		return 0, 0, nil, err
	}
	return header[3], header[4], payload, nil
}

// Settings returns the server's first SETTINGS frame, by identifier, and acknowledges it.
func (c *H2Conn) Settings(t testing.TB) map[uint16]uint32 {
	t.Helper()
	for {
		typ, flags, payload, err := c.read()
		if err != nil {
			t.Fatal(err)
		}
		if typ != H2FrameSettings || flags&0x1 != 0 {
			continue
		}
		out := map[uint16]uint32{}
		for ; len(payload) >= 6; payload = payload[6:] {
			out[binary.BigEndian.Uint16(payload)] = binary.BigEndian.Uint32(payload[2:])
		}
		c.Write(t, H2FrameSettings, 0x1, nil) // ACK
		return out
	}
}

// GoAway reads until the server sends GOAWAY, and returns its error code; ok is false when the
// connection ends without one.
func (c *H2Conn) GoAway(t testing.TB) (code uint32, ok bool) {
	t.Helper()
	for {
		typ, _, payload, err := c.read()
		if errors.Is(err, io.EOF) {
			return 0, false
		}
		if err != nil {
			t.Fatal(err)
		}
		if typ == H2FrameGoAway && len(payload) >= 8 {
			return binary.BigEndian.Uint32(payload[4:]), true
		}
	}
}
