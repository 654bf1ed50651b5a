package pki_test

import (
	"bytes"
	"crypto"
	"crypto/ecdh"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"slices"
	"testing"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// fuzzMaterial is key material generated for one fuzzing run, never committed.
type fuzzMaterial struct {
	ecKey   *ecdsa.PrivateKey
	p384    *ecdsa.PrivateKey
	rsaKey  *rsa.PrivateKey
	edKey   ed25519.PrivateKey
	xKey    *ecdh.PrivateKey
	ecCert  *x509.Certificate
	rsaCert *x509.Certificate
	edCert  *x509.Certificate
}

func newFuzzMaterial(f *testing.F) *fuzzMaterial {
	f.Helper()
	m := &fuzzMaterial{}
	var err error
	if m.ecKey, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader); err != nil {
		f.Fatal(err)
	}
	if m.p384, err = ecdsa.GenerateKey(elliptic.P384(), rand.Reader); err != nil {
		f.Fatal(err)
	}
	if m.rsaKey, err = rsa.GenerateKey(rand.Reader, 2048); err != nil {
		f.Fatal(err)
	}
	if _, m.edKey, err = ed25519.GenerateKey(rand.Reader); err != nil {
		f.Fatal(err)
	}
	if m.xKey, err = ecdh.X25519().GenerateKey(rand.Reader); err != nil {
		f.Fatal(err)
	}
	m.ecCert = testutil.NewRootCA(f, testutil.CAOptions{CommonName: "fuzz ec", Key: m.ecKey}).Cert
	m.rsaCert = testutil.NewRootCA(f, testutil.CAOptions{CommonName: "fuzz rsa", Key: m.rsaKey}).Cert
	m.edCert = testutil.NewRootCA(f, testutil.CAOptions{CommonName: "fuzz ed25519", Key: m.edKey}).Cert
	return m
}

func (m *fuzzMaterial) pkcs8(f *testing.F, key any) []byte {
	f.Helper()
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		f.Fatal(err)
	}
	return pemBlock(pki.BlockPrivateKey, der)
}

func (m *fuzzMaterial) pkix(f *testing.F, pub any) []byte {
	f.Helper()
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		f.Fatal(err)
	}
	return pemBlock(pki.BlockPublicKey, der)
}

// pemBlocks decodes data as the parsers do, keeping the blocks of the given types.
func pemBlocks(data []byte, types ...string) []*pem.Block {
	var out []*pem.Block
	for rest := data; ; {
		var block *pem.Block
		if block, rest = pem.Decode(rest); block == nil {
			return out
		}
		if slices.Contains(types, block.Type) {
			out = append(out, block)
		}
	}
}

// FuzzParseCertificates feeds arbitrary bytes to ParseCertificates, which reads every
// certificate of a cacerts bundle, a trust bundle and a workload chain. A refusal is an error
// and no certificates; without any CERTIFICATE block, ErrNoPEM. An acceptance is never empty:
// it is one certificate per CERTIFICATE block, in order, each the block's DER, and what it
// returns encodes and parses back to the same certificates.
func FuzzParseCertificates(f *testing.F) {
	m := newFuzzMaterial(f)
	for _, seed := range [][]byte{
		testutil.CertPEM(m.ecCert),
		testutil.CertPEM(m.ecCert, m.rsaCert, m.edCert),
		concat(m.pkcs8(f, m.ecKey), testutil.CertPEM(m.ecCert), []byte("trailing text\n")),
		concat([]byte("# comment\n"), testutil.CertPEM(m.rsaCert), pemBlock(pki.BlockCertificate, []byte{0x30, 0x00})),
		pemBlock(pki.BlockCertificate, m.ecCert.Raw[:len(m.ecCert.Raw)-1]),
		pemBlock(pki.BlockCertificate, append(slices.Clone(m.ecCert.Raw), 0)),
		m.pkix(f, m.ecKey.Public()),
		pemBlock(pki.BlockCertificate, unknownKeyAlgorithm(f, m.ecCert)),
		nil,
	} {
		f.Add(seed)
	}

	f.Fuzz(func(t *testing.T, data []byte) {
		certs, err := pki.ParseCertificates(data)
		blocks := pemBlocks(data, pki.BlockCertificate)
		if err != nil {
			if certs != nil || err.Error() == "" {
				t.Fatalf("refused with %q, and %d certificates", err, len(certs))
			}
			if errors.Is(err, pki.ErrNoPEM) != (len(blocks) == 0) {
				t.Fatalf("%d CERTIFICATE blocks, refused with %v", len(blocks), err)
			}
			return
		}
		if len(certs) == 0 || len(certs) != len(blocks) {
			t.Fatalf("%d certificates of %d CERTIFICATE blocks", len(certs), len(blocks))
		}
		for i, c := range certs {
			if c == nil || !bytes.Equal(c.Raw, blocks[i].Bytes) {
				t.Fatalf("certificate %d is not block %d's", i+1, i+1)
			}
		}
		again, err := pki.ParseCertificates(pki.EncodeCertificates(certs...))
		if err != nil || !slices.EqualFunc(certs, again, (*x509.Certificate).Equal) {
			t.Fatalf("the certificates, encoded again, parse to %d certificates: %v", len(again), err)
		}
	})
}

// FuzzParsePrivateKey feeds arbitrary bytes to ParsePrivateKey, which reads a cacerts key, the
// token signing key and a workload key from disk. A refusal is an error and no key. An accepted
// key is the first PKCS#8, SEC 1 or PKCS#1 block's; its public half writes as PKIX and parses
// back equal; it signs, and its public half verifies what it signed; and it writes as PKCS#8
// and parses back to the same key.
func FuzzParsePrivateKey(f *testing.F) {
	m := newFuzzMaterial(f)
	sec1, err := x509.MarshalECPrivateKey(m.p384)
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range [][]byte{
		m.pkcs8(f, m.ecKey),
		m.pkcs8(f, m.rsaKey),
		m.pkcs8(f, m.edKey),
		m.pkcs8(f, m.xKey),
		pemBlock(pki.BlockECPrivateKey, sec1),
		pemBlock(pki.BlockRSAPrivateKey, x509.MarshalPKCS1PrivateKey(m.rsaKey)),
		concat(testutil.CertPEM(m.ecCert), pemBlock(pki.BlockECPrivateKey, sec1)),
		concat(pemBlock(pki.BlockECPrivateKey, []byte{0x30, 0x00}), m.pkcs8(f, m.ecKey)),
		pemBlock(pki.BlockRSAPrivateKey, sec1),
		nil,
	} {
		f.Add(seed)
	}

	f.Fuzz(func(t *testing.T, data []byte) {
		key, err := pki.ParsePrivateKey(data)
		if err != nil {
			if key != nil || err.Error() == "" {
				t.Fatalf("refused with %q, and a %T", err, key)
			}
			return
		}
		if blocks := pemBlocks(data, pki.BlockPrivateKey, pki.BlockECPrivateKey, pki.BlockRSAPrivateKey); len(blocks) == 0 {
			t.Fatal("a key accepted without any private key block")
		}
		pub := key.Public()
		der, err := x509.MarshalPKIXPublicKey(pub)
		if err != nil {
			t.Fatalf("the public half of a %T does not write as PKIX: %v", key, err)
		}
		parsed, err := x509.ParsePKIXPublicKey(der)
		if err != nil || !pki.PublicKeysEqual(pub, parsed) {
			t.Fatalf("the public half of a %T, as PKIX, parses to %T: %v", key, parsed, err)
		}
		checkSigns(t, key)
		encoded, err := pki.EncodePrivateKey(key)
		if err != nil {
			t.Fatalf("an accepted %T does not write as PKCS#8: %v", key, err)
		}
		again, err := pki.ParsePrivateKey(encoded)
		if err != nil || !pki.PublicKeysEqual(pub, again.Public()) {
			t.Fatalf("an accepted %T, as PKCS#8, parses to %T: %v", key, again, err)
		}
	})
}

// checkSigns signs a digest with key and verifies the signature with its public half.
func checkSigns(t *testing.T, key crypto.Signer) {
	t.Helper()
	msg := []byte("meshid fuzz")
	digest := sha256.Sum256(msg)
	switch pub := key.Public().(type) {
	case *ecdsa.PublicKey:
		sig, err := key.Sign(rand.Reader, digest[:], crypto.SHA256)
		if err != nil || !ecdsa.VerifyASN1(pub, digest[:], sig) {
			t.Fatalf("an ECDSA %s key's signature does not verify: %v", pub.Curve.Params().Name, err)
		}
	case *rsa.PublicKey:
		sig, err := key.Sign(rand.Reader, digest[:], crypto.SHA256)
		if err == nil {
			err = rsa.VerifyPKCS1v15(pub, crypto.SHA256, digest[:], sig)
		}
		if err != nil {
			t.Fatalf("an RSA %d key's signature does not verify: %v", pub.N.BitLen(), err)
		}
	case ed25519.PublicKey:
		sig, err := key.Sign(rand.Reader, msg, crypto.Hash(0))
		if err != nil || !ed25519.Verify(pub, msg, sig) {
			t.Fatalf("an Ed25519 key's signature does not verify: %v", err)
		}
	default:
		t.Fatalf("accepted a private key whose public half is a %T", pub)
	}
}

// FuzzParsePublicKeys feeds arbitrary bytes to ParsePublicKeys, which reads --jwt-keys in PEM.
// A refusal is an error and no keys; without any key block, ErrNoPEM. An acceptance is one key
// per PUBLIC KEY, RSA PUBLIC KEY and CERTIFICATE block, in order, and never a nil key.
func FuzzParsePublicKeys(f *testing.F) {
	m := newFuzzMaterial(f)
	for _, seed := range [][]byte{
		m.pkix(f, m.ecKey.Public()),
		concat(m.pkix(f, m.p384.Public()), m.pkix(f, m.edKey.Public()), m.pkix(f, m.xKey.PublicKey())),
		pemBlock(pki.BlockRSAPublicKey, x509.MarshalPKCS1PublicKey(&m.rsaKey.PublicKey)),
		testutil.CertPEM(m.ecCert, m.rsaCert, m.edCert),
		concat(m.pkcs8(f, m.ecKey), m.pkix(f, m.rsaKey.Public())),
		pemBlock(pki.BlockPublicKey, []byte{0x30, 0x00}),
		pemBlock(pki.BlockCertificate, unknownKeyAlgorithm(f, m.ecCert)),
		nil,
	} {
		f.Add(seed)
	}

	f.Fuzz(func(t *testing.T, data []byte) {
		keys, err := pki.ParsePublicKeys(data)
		blocks := pemBlocks(data, pki.BlockPublicKey, pki.BlockRSAPublicKey, pki.BlockCertificate)
		if err != nil {
			if keys != nil || err.Error() == "" {
				t.Fatalf("refused with %q, and %d keys", err, len(keys))
			}
			if errors.Is(err, pki.ErrNoPEM) != (len(blocks) == 0) {
				t.Fatalf("%d key blocks, refused with %v", len(blocks), err)
			}
			return
		}
		if len(keys) == 0 || len(keys) != len(blocks) {
			t.Fatalf("%d keys of %d key blocks", len(keys), len(blocks))
		}
		for i, k := range keys {
			if k == nil {
				t.Fatalf("key %d (a %s block) is nil", i+1, blocks[i].Type)
			}
		}
	})
}
