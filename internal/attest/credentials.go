package attest

import (
	"context"
	"errors"
	"net"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// AuthInfo is what the handshake learnt of a connection's peer: the process, or why it is not
// known. A connection whose peer is not known is still served, so that its calls are refused,
// logged and counted where the caller is told why.
type AuthInfo struct {
	credentials.CommonAuthInfo
	Process Process
	// Err says why Process is not known (ErrPeerUnknown, ErrProcessGone, ErrPIDReused).
	Err error
	// Inner is the AuthInfo of the credentials these wrap, if any.
	Inner credentials.AuthInfo
}

// AuthType names the credentials.
func (AuthInfo) AuthType() string { return "unix-attested" }

// Unwrap returns the wrapped credentials' AuthInfo, for code that looks for its own.
func (a AuthInfo) Unwrap() credentials.AuthInfo { return a.Inner }

// authInfoFrom finds the handshake's AuthInfo of a call's peer.
func authInfoFrom(ctx context.Context) (AuthInfo, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return AuthInfo{}, false
	}
	info, ok := p.AuthInfo.(AuthInfo)
	return info, ok
}

// credentialsOf attests each connection's peer at the handshake, once per connection.
type credentialsOf struct {
	proc  ProcFS
	inner credentials.TransportCredentials
}

// Credentials are gRPC transport credentials for a Unix socket server that read each
// connection's peer at the handshake (SO_PEERCRED, then /proc), for Identify. They secure
// nothing themselves: the socket's mode says who may connect. inner, if not nil, handshakes
// first (a server's admission) and its AuthInfo is kept in AuthInfo.Inner.
func (a *Attestor) Credentials(inner credentials.TransportCredentials) credentials.TransportCredentials {
	return &credentialsOf{proc: a.proc, inner: inner}
}

func (c *credentialsOf) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	raw := conn
	info := AuthInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}
	if c.inner != nil {
		var (
			inner credentials.AuthInfo
			err   error
		)
		if conn, inner, err = c.inner.ServerHandshake(conn); err != nil {
			return nil, nil, err
		}
		info.Inner = inner
		if ci, ok := inner.(interface {
			GetCommonAuthInfo() credentials.CommonAuthInfo
		}); ok {
			info.CommonAuthInfo = ci.GetCommonAuthInfo()
		}
	}
	info.Process, info.Err = Attest(raw, c.proc)
	return conn, info, nil
}

func (c *credentialsOf) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("these credentials are for serving")
}

func (c *credentialsOf) Info() credentials.ProtocolInfo {
	if c.inner != nil {
		return c.inner.Info()
	}
	return credentials.ProtocolInfo{SecurityProtocol: "unix-attested"}
}

func (c *credentialsOf) Clone() credentials.TransportCredentials {
	clone := *c
	if c.inner != nil {
		clone.inner = c.inner.Clone()
	}
	return &clone
}

func (c *credentialsOf) OverrideServerName(string) error { return nil }

// Attest reads who is at the other end of a Unix connection: the credentials the kernel recorded
// when it connected, and what proc says of its pid now.
func Attest(conn net.Conn, proc ProcFS) (Process, error) {
	pid, uid, gid, err := peerCred(conn)
	if err != nil {
		return Process{}, err
	}
	p, err := proc.Read(pid)
	if err != nil {
		// The kernel's credentials still name the caller in the refusal's log line.
		return Process{PID: pid, UID: uid, GID: gid}, err
	}
	p.UID, p.GID = uid, gid
	return p, nil
}
