package kube

import (
	"context"
	"crypto"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshid/meshid/ca"
)

// The Secret, in the CA namespace, that holds the JWT-SVID signing key: one key for every
// replica, so that a JWT-SVID minted through one verifies with the bundle any other serves.
const (
	JWTSVIDKeySecret = "meshid-jwt-svid" //nolint:gosec // a Secret's name, not a credential
	// JWTSVIDKeySecretType is the type of the Secret we create; a Secret made by hand
	// (kubectl create secret generic) is read too.
	JWTSVIDKeySecretType corev1.SecretType = "meshid.io/jwt-svid-key" //nolint:gosec // a type name, not a credential
	// JWTSVIDKeyData is the Secret's key holding the PEM private key.
	JWTSVIDKeyData = "key.pem"
)

// LoadOrCreateJWTSVIDKey returns the JWT-SVID signing key held by the Secret JWTSVIDKeySecret in
// namespace, after creating the Secret with a new ECDSA P-256 key when there is none, and reports
// whether this call created it. A replica that loses the race to create it uses the winner's. A
// Secret whose key is not ECDSA P-256 is refused: the CA does not start on it.
func LoadOrCreateJWTSVIDKey(ctx context.Context, clients *Clients, namespace string) (crypto.Signer, bool, error) {
	switch {
	case clients == nil:
		return nil, false, errors.New("JWT-SVID key: no Kubernetes clients")
	case namespace == "":
		return nil, false, errors.New("JWT-SVID key: no CA namespace")
	}
	where := "secret " + namespace + "/" + JWTSVIDKeySecret
	secrets := clients.Core.Secrets(namespace)
	s, err := secrets.Get(ctx, JWTSVIDKeySecret, metav1.GetOptions{})
	switch {
	case err == nil:
		key, err := jwtSVIDKeyOf(s, where)
		return key, false, err
	case !apierrors.IsNotFound(err):
		return nil, false, fmt.Errorf("get %s: %w", where, err)
	}

	keyPEM, err := ca.GenerateJWTSVIDKey()
	if err != nil {
		return nil, false, fmt.Errorf("generate the JWT-SVID key for %s: %w", where, err)
	}
	created, err := secrets.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: JWTSVIDKeySecret, Namespace: namespace},
		Type:       JWTSVIDKeySecretType,
		Data:       map[string][]byte{JWTSVIDKeyData: keyPEM},
	}, metav1.CreateOptions{})
	switch {
	case err == nil:
		key, err := jwtSVIDKeyOf(created, where)
		return key, err == nil, err
	case apierrors.IsAlreadyExists(err):
		// Another replica (or an operator) was first: theirs is the key.
		s, err := secrets.Get(ctx, JWTSVIDKeySecret, metav1.GetOptions{})
		if err != nil {
			return nil, false, fmt.Errorf("get %s, created by another writer: %w", where, err)
		}
		key, err := jwtSVIDKeyOf(s, where)
		return key, false, err
	default:
		return nil, false, fmt.Errorf("create %s: %w", where, err)
	}
}

// jwtSVIDKeyOf parses and checks the key a Secret holds. The error names the Secret and what is
// wrong, never the data.
func jwtSVIDKeyOf(s *corev1.Secret, where string) (crypto.Signer, error) {
	data, ok := s.Data[JWTSVIDKeyData]
	if !ok {
		return nil, fmt.Errorf("%s has no %s", where, JWTSVIDKeyData)
	}
	key, err := ca.ParseJWTSVIDKey(data)
	if err != nil {
		return nil, fmt.Errorf("%s, %s: %w", where, JWTSVIDKeyData, err)
	}
	return key, nil
}
