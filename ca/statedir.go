package ca

import (
	"path/filepath"

	"github.com/meshid/meshid/internal/fsutil"
)

// The layout of a CA state dir: the self-signed CA (CAKeyFile, CACertFile), the trust bundle
// (RootCertFile), the local token signing key (TokenKeyFile), the JWT-SVID signing key
// (JWTSVIDKeyFile), and the service-account secrets the secret controller writes off Kubernetes.

// SecretsDir is where the CA whose state dir is stateDir writes service-account secrets.
func SecretsDir(stateDir string) string { return filepath.Join(stateDir, "secrets") }

// TokenKeyPath is where the CA whose state dir is stateDir keeps its local token signing key:
// what `meshid token` and an embedding agent mint with (see token.LoadMinter).
func TokenKeyPath(stateDir string) string { return filepath.Join(stateDir, TokenKeyFile) }

// RootCertPath is the trust bundle of the CA whose state dir is stateDir: every root it trusts,
// what verifies it.
func RootCertPath(stateDir string) string { return filepath.Join(stateDir, RootCertFile) }

// CheckStateDir refuses (fsutil.ErrNotOwned) a state dir that is not ours alone: one that
// another user owns or can write in, a CA key or token key in it that is a link, another user's
// or open to others, or a secrets tree reached through a link. Whoever could write there could
// have put their own keys there, and the CA would sign what they ask. A missing state dir
// passes: the CA makes it private, and checks it again once made.
func CheckStateDir(stateDir string) error {
	if err := fsutil.CheckOwnedDir(stateDir); err != nil {
		return err
	}
	for _, name := range []string{CAKeyFile, TokenKeyFile, JWTSVIDKeyFile, UpstreamCAFile} {
		if err := fsutil.CheckKeyFile(filepath.Join(stateDir, name)); err != nil {
			return err
		}
	}
	return fsutil.CheckOwnedSubdir(SecretsDir(stateDir))
}
