// Package jwtsvidpb holds the Go stubs of meshid's JWT-SVID protocol (jwtsvid.proto), generated
// by hack/genproto.sh: the agent's CA client and meshid ca's service use them.
package jwtsvidpb
