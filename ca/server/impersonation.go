package server

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// ImpersonatedIdentityKey is the key of IstioCertificateRequest.metadata under which a node
// agent names the workload it asks for (Istio's security.ImpersonatedIdentity, which ztunnel
// sends): a SPIFFE ID, as a string value. An empty string asks for nothing, as in Istio.
const ImpersonatedIdentityKey = "ImpersonatedIdentity"

// NodeAccount is a service account trusted to ask for its node's workloads' identities
// (--trusted-node-accounts, Istio's CA_TRUSTED_NODE_ACCOUNTS).
type NodeAccount struct {
	Namespace      string
	ServiceAccount string
}

// String returns NAMESPACE/SERVICE_ACCOUNT, as the flag takes it.
func (a NodeAccount) String() string { return a.Namespace + "/" + a.ServiceAccount }

// BoundPod is the pod a caller's token is bound to (the kubernetes.io pod claims, or the
// TokenReview's authentication.kubernetes.io/pod-name and pod-uid); zero when it is bound to none.
type BoundPod struct {
	Name string
	UID  string
}

// NodeAuthorizer decides, on Kubernetes, whether the identity a trusted node agent asks for
// runs on that agent's node. It returns nil, or an error wrapping ErrNoBoundPod,
// ErrCallerPodUnknown, ErrNotOnNode or ErrNodesUnavailable.
type NodeAuthorizer interface {
	OnCallersNode(ctx context.Context, caller Caller, target pki.SPIFFEID) error
}

// Errors of a NodeAuthorizer, mapped to status codes by the server.
var (
	// ErrNoBoundPod: the caller's token is bound to no pod, so its node is unknown. PermissionDenied.
	ErrNoBoundPod = errors.New("the caller's token is bound to no pod, so its node is unknown")
	// ErrCallerPodUnknown: the pod the caller's token is bound to is not (or no longer) a
	// live pod of the caller's service account on a node. PermissionDenied.
	ErrCallerPodUnknown = errors.New("the caller's pod is not a live pod of its service account on a node")
	// ErrNotOnNode: the identity asked for has no live pod on the caller's node. PermissionDenied.
	ErrNotOnNode = errors.New("the identity asked for has no live pod on the caller's node")
	// ErrNodesUnavailable: the pods are not known yet; the caller may retry. Unavailable.
	ErrNodesUnavailable = errors.New("the CA does not know the cluster's pods yet")
)

var (
	errImpersonationNotTrusted    = errors.New("the caller is not a trusted node account, so it may ask only for its own identity")
	errImpersonationByCertificate = errors.New("another identity is signed only for a caller authenticated by a token, not by a client certificate")
	errImpersonationMalformed     = errors.New("metadata " + ImpersonatedIdentityKey + " is not a workload SPIFFE ID (spiffe://TRUST_DOMAIN/ns/NAMESPACE/sa/SERVICE_ACCOUNT)")
	errImpersonationTrustDomain   = errors.New("the impersonated identity is not of this CA's trust domain")
	errImpersonationCACert        = errors.New("a CA certificate is never signed for an impersonated identity")
)

// impersonation is what a request asks of impersonation: raw is the metadata's value, set
// when the key is there (ok).
type impersonation struct {
	raw string
	ok  bool
	err error // the key is there, but not as a string
}

// impersonationOf reads the ImpersonatedIdentity metadata of an Istio request.
func impersonationOf(md *structpb.Struct) impersonation {
	v, ok := md.GetFields()[ImpersonatedIdentityKey]
	if !ok {
		return impersonation{}
	}
	s, isString := v.GetKind().(*structpb.Value_StringValue)
	if !isString {
		return impersonation{ok: true, err: fmt.Errorf("%w: not a string", errImpersonationMalformed)}
	}
	if s.StringValue == "" {
		return impersonation{} // Istio's "no impersonation"
	}
	return impersonation{raw: s.StringValue, ok: true}
}

// impersonate checks that caller may have a certificate for the identity imp names, and returns
// it: a trusted node account authenticated by a token, asking for a workload identity of this
// trust domain that, on Kubernetes, runs on its node.
func (s *Server) impersonate(ctx context.Context, caller Caller, imp impersonation) (pki.SPIFFEID, error) {
	if imp.err != nil {
		return pki.SPIFFEID{}, imp.err
	}
	if _, ok := s.trustedNodes[NodeAccount{Namespace: caller.Identity.Namespace, ServiceAccount: caller.Identity.ServiceAccount}]; !ok {
		return pki.SPIFFEID{}, errImpersonationNotTrusted
	}
	// As a CA certificate: any CA under the root can mint a client certificate naming a node account.
	if !caller.ByToken {
		return pki.SPIFFEID{}, errImpersonationByCertificate
	}
	target, err := pki.ParseSPIFFEID(imp.raw)
	if err != nil {
		// pki's error quotes the whole value: bounded here instead.
		return pki.SPIFFEID{}, fmt.Errorf("%w: %q", errImpersonationMalformed, logkey.Untrusted(imp.raw))
	}
	// Every authenticator maps its callers into the CA's one trust domain.
	if target.TrustDomain != caller.Identity.TrustDomain {
		return pki.SPIFFEID{}, fmt.Errorf("%w: %q, want %q", errImpersonationTrustDomain,
			logkey.Untrusted(target.TrustDomain), caller.Identity.TrustDomain)
	}
	if s.nodes != nil {
		if err := s.nodes.OnCallersNode(ctx, caller, target); err != nil {
			return pki.SPIFFEID{}, err
		}
	}
	return target, nil
}
