package cli

import (
	"errors"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/fsutil"
)

// refusedAsCalled are the errors, found once a command runs, that still come from how it was
// called: what it was pointed at cannot be used as it is.
func refusedAsCalled() []error {
	return []error{
		agent.ErrNoCA,          // the slim agent with no CA to turn to
		agent.ErrConfigRefused, // a path given that does not exist or holds the wrong thing
		fsutil.ErrNotOwned,     // a state, output or key directory another user owns or can write in
		fsutil.ErrLocked,       // a directory another agent holds
	}
}

// RefusedAsCalled returns err as a UsageError, so that the process exits 2 as for a bad flag,
// when it wraps one of the refusals a command can only find as it starts; any other error is
// returned as it is.
func RefusedAsCalled(err error) error {
	for _, refusal := range refusedAsCalled() {
		if errors.Is(err, refusal) {
			return usage(err)
		}
	}
	return err
}
