// Package spire holds interoperability tests of the agent's SPIFFE Workload API against clients
// that SPIFFE's maintainers wrote: spire-agent's `api fetch x509` and `api watch`, SPIRE's own
// binary, and spiffe-helper, each built unmodified at a pinned version by hack/spire-env.sh and
// hack/spiffe-helper-env.sh. It has no code of its own; the tests are in its _test.go files.
package spire
