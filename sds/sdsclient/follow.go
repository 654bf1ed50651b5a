package sdsclient

import (
	"context"
	"errors"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Follow keeps a StreamSecrets subscription to names open, as Envoy does, until ctx ends: it
// hands each response to received and then acknowledges it. When a stream ends because the server
// went away, Follow opens another, waiting until the server is back (grpc.WaitForReady; how soon
// it notices is the connection's backoff, see WithDialOptions), and subscribes again. opened, when
// not nil, is called each time a stream has opened, before its first request: what the caller
// held from the last stream no longer holds.
//
// Follow returns ctx's error once ctx ends, and otherwise what no new stream would mend: the
// error received returned, a response that wraps ErrProtocol, a refusal (InvalidArgument,
// NotFound, PermissionDenied, Unauthenticated, FailedPrecondition, Unimplemented), or a stream
// that could not be opened (the connection closed). Call it on a goroutine of its own.
func (c *Client) Follow(ctx context.Context, names []string, opened func(), received func(Response) error) error {
	for ctx.Err() == nil {
		if err := c.followStream(ctx, names, opened, received); err != nil {
			if ctx.Err() != nil {
				break
			}
			return err
		}
	}
	return ctx.Err()
}

// followStream follows one stream; nil means that it ended and another may mend it.
func (c *Client) followStream(ctx context.Context, names []string, opened func(), received func(Response) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.StreamSecrets(ctx, grpc.WaitForReady(true))
	if err != nil {
		return err // ctx ended, or the connection is closed: WaitForReady waits out the rest
	}
	if opened != nil {
		opened()
	}
	if err := st.Subscribe(names...); err != nil {
		return nil // the stream broke already; Recv would tell why, another stream mends it
	}
	var failed error
	err = st.Follow(names, func(r Response) error {
		failed = received(r)
		return failed
	})
	switch {
	case failed != nil:
		return failed
	case errors.Is(err, ErrProtocol):
		return err
	}
	switch status.Code(err) {
	case codes.InvalidArgument, codes.NotFound, codes.PermissionDenied, codes.Unauthenticated,
		codes.FailedPrecondition, codes.Unimplemented:
		return err
	}
	return nil
}
