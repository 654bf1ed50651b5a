package caclient

import (
	"errors"
	"fmt"
	"os"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
)

// CheckRootFile says what is wrong with a file of roots that verify a CA or a discovery server,
// completing "PATH ...": it does not exist (absent says when it could be), cannot be read, holds
// no PEM certificate, or holds one that does not parse. The client would otherwise start, and
// every call fail.
func CheckRootFile(file, absent string) error {
	data, err := os.ReadFile(file)
	if err != nil {
		return fsutil.GivenPathError(err, absent)
	}
	if _, err := pki.ParseCertificates(data); errors.Is(err, pki.ErrNoPEM) {
		return errors.New("holds no PEM certificate")
	} else if err != nil {
		return fmt.Errorf("holds a certificate that does not parse: %w", err)
	}
	return nil
}
