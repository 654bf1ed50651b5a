package sds_test

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// h2Conn speaks raw HTTP/2 frames to the server, to see what a gRPC client hides: the settings
// the server advertises and how it answers a misbehaving peer.
type h2Conn struct {
	net.Conn
}

// HTTP/2 (RFC 9113) frame types, settings and error codes used here.
const (
	h2FrameSettings               = 0x4
	h2FramePing                   = 0x6
	h2FrameGoAway                 = 0x7
	h2SettingMaxConcurrentStreams = 0x3
	h2ErrEnhanceYourCalm          = 0xb
)

// h2Dial connects and sends the client preface and empty settings.
func h2Dial(t *testing.T, socket string) *h2Conn {
	t.Helper()
	conn, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	// The deadline only bounds a broken test.
	if err := conn.SetDeadline(time.Now().Add(waitLimit)); err != nil {
		t.Fatal(err)
	}
	c := &h2Conn{Conn: conn}
	if _, err := io.WriteString(conn, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	c.write(t, h2FrameSettings, 0, nil)
	return c
}

func (c *h2Conn) write(t *testing.T, typ, flags byte, payload []byte) {
	t.Helper()
	frame := make([]byte, 9, 9+len(payload))
	frame[0], frame[1], frame[2] = byte(len(payload)>>16), byte(len(payload)>>8), byte(len(payload))
	frame[3], frame[4] = typ, flags
	if _, err := c.Write(append(frame, payload...)); err != nil {
		t.Fatal(err)
	}
}

// read returns the next frame; io.EOF once the server has closed the connection.
func (c *h2Conn) read() (typ, flags byte, payload []byte, err error) {
	var header [9]byte
	if _, err := io.ReadFull(c, header[:]); err != nil {
		return 0, 0, nil, err
	}
	payload = make([]byte, int(header[0])<<16|int(header[1])<<8|int(header[2]))
	if _, err := io.ReadFull(c, payload); err != nil {
		return 0, 0, nil, err
	}
	return header[3], header[4], payload, nil
}

// settings returns the server's first SETTINGS frame, by identifier.
func (c *h2Conn) settings(t *testing.T) map[uint16]uint32 {
	t.Helper()
	for {
		typ, flags, payload, err := c.read()
		if err != nil {
			t.Fatal(err)
		}
		if typ != h2FrameSettings || flags&0x1 != 0 {
			continue
		}
		out := map[uint16]uint32{}
		for ; len(payload) >= 6; payload = payload[6:] {
			out[binary.BigEndian.Uint16(payload)] = binary.BigEndian.Uint32(payload[2:])
		}
		c.write(t, h2FrameSettings, 0x1, nil) // ACK
		return out
	}
}

// goaway reads until the server sends GOAWAY, and returns its error code; ok is false when the
// connection ends without one.
func (c *h2Conn) goaway(t *testing.T) (code uint32, ok bool) {
	t.Helper()
	for {
		typ, _, payload, err := c.read()
		if errors.Is(err, io.EOF) {
			return 0, false
		}
		if err != nil {
			t.Fatal(err)
		}
		if typ == h2FrameGoAway && len(payload) >= 8 {
			return binary.BigEndian.Uint32(payload[4:]), true
		}
	}
}
