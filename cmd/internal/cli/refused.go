package cli

import (
	"errors"

	"github.com/meshid/meshid/agent"
)

// RefusedAsCalled returns err as a UsageError, so that the process exits 2, when it wraps one of
// the refusals a command can only find as it starts, which are the caller's mistakes as much as a
// bad flag is: no CA to turn to, a path given that does not exist or holds the wrong thing, an
// incomplete credentials dir. Any other error is returned as it is.
func RefusedAsCalled(err error) error {
	for _, refusal := range []error{agent.ErrNoCA, agent.ErrConfigRefused} {
		if errors.Is(err, refusal) {
			return UsageError{err}
		}
	}
	return err
}
