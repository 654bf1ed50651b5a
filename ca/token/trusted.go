package token

import (
	"log/slog"

	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// TrustedKeys loads the keys a CA verifies tokens with: the issuer keys in file (PEM public keys
// or a JWKS) when it is given, else the CA's own local signing key at localKey, created on first
// use, which `meshid token` and an embedding agent mint with. log is told which, and from where.
func TrustedKeys(file, localKey string, log *slog.Logger) (*KeySet, error) {
	if file != "" {
		keys, err := LoadKeySet(file)
		if err != nil {
			return nil, err
		}
		log.Info("trusting token issuer keys", logkey.Path, file, logkey.Keys, keys.Len())
		return keys, nil
	}
	key, created, err := LoadOrCreateKey(localKey)
	if err != nil {
		return nil, err
	}
	kid, err := pki.KeyID(key.Public())
	if err != nil {
		return nil, err
	}
	keys, err := NewKeySet(key.Public())
	if err != nil {
		return nil, err
	}
	log.Info("trusting the local token signing key", logkey.Path, localKey, logkey.KeyID, kid, logkey.Created, created)
	return keys, nil
}
