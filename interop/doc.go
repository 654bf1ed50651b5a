// Package interop holds interoperability tests against real third-party agents: Istio's
// pilot-agent, built at a pinned version by hack/istio-env.sh, gets its workload certificate from
// meshid's CA and its Envoy configuration from meshid's discovery server. It has no code of its
// own; the tests are in its _test.go files.
package interop
