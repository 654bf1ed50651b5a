package sds

import (
	"crypto/x509"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/secretmanager"
)

// A response sent from its shared body is, byte for byte, what proto.Marshal makes of the whole
// response: the body and the nonce field are the message's encoding in field order. Other
// messages go through grpc's protobuf codec unchanged.
func TestEncodedResponses(t *testing.T) {
	t.Parallel()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	leaf, key := root.IssueWorkload(t, "spiffe://cluster.local/ns/default/sa/demo", time.Hour)
	secret := &secretmanager.Secret{Name: "default", Version: "7f", KeyPair: &secretmanager.KeyPair{
		Chain: []*x509.Certificate{leaf, root.Cert}, ChainPEM: testutil.CertPEM(leaf, root.Cert), Key: key, KeyPEM: testutil.KeyPEM(t, key)}}
	resource, _, err := toResource(secret, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	sotw, err := encodeSotW(resource, secret.Version)
	if err != nil {
		t.Fatal(err)
	}
	var b bodies
	delta := b.deltaBody("default", secret.Version, resource)
	if again := b.deltaBody("default", secret.Version, resource); &again[0] != &delta[0] {
		t.Error("the delta body of the same name was encoded again")
	}
	other := b.deltaBody("file-cert:/c.pem~/k.pem", secret.Version, resource)
	c := newCodec()
	for _, tc := range []struct {
		name  string
		body  []byte
		whole proto.Message
	}{
		{"sotw", sotw, &discovery.DiscoveryResponse{VersionInfo: "7f", Resources: []*anypb.Any{resource}, TypeUrl: SecretTypeURL, Nonce: "12"}},
		{"delta", delta, &discovery.DeltaDiscoveryResponse{SystemVersionInfo: "7f", TypeUrl: SecretTypeURL, Nonce: "12",
			Resources: []*discovery.Resource{{Name: "default", Version: "7f", Resource: resource}}}},
		{"delta-other-name", other, &discovery.DeltaDiscoveryResponse{SystemVersionInfo: "7f", TypeUrl: SecretTypeURL, Nonce: "12",
			Resources: []*discovery.Resource{{Name: "file-cert:/c.pem~/k.pem", Version: "7f", Resource: resource}}}},
		{"long-nonce", sotw, &discovery.DiscoveryResponse{VersionInfo: "7f", Resources: []*anypb.Any{resource}, TypeUrl: SecretTypeURL,
			Nonce: string(make([]byte, 300))}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nonce := tc.whole.ProtoReflect().Get(tc.whole.ProtoReflect().Descriptor().Fields().ByName("nonce")).String()
			got, err := c.Marshal(&encodedResponse{body: tc.body, nonce: nonce})
			if err != nil {
				t.Fatal(err)
			}
			want, err := proto.Marshal(tc.whole)
			if err != nil {
				t.Fatal(err)
			}
			if string(got.Materialize()) != string(want) {
				t.Fatalf("encoded response differs from proto.Marshal's:\n got %x\nwant %x", got.Materialize(), want)
			}
			// A decoded copy says the same: Envoy reads it as the whole message.
			decoded := tc.whole.ProtoReflect().New().Interface()
			if err := c.Unmarshal(got, decoded); err != nil || !proto.Equal(decoded, tc.whole) {
				t.Fatalf("decoded %v (%v), want %v", decoded, err, tc.whole)
			}
		})
	}
	// The field number the codec writes is the nonce's in both types.
	for _, m := range []proto.Message{&discovery.DiscoveryResponse{}, &discovery.DeltaDiscoveryResponse{}} {
		if n := m.ProtoReflect().Descriptor().Fields().ByName("nonce").Number(); n != nonceField {
			t.Errorf("%T: nonce is field %d, the codec writes %d", m, n, nonceField)
		}
	}
}
