//go:build !external

package kube_test

import "testing"

// Every test of this package runs on a real kube-apiserver and etcd, which hack/kube-env.sh
// builds from the module proxy: they are built with -tags external, as make test does, so that
// a plain go test needs nothing from outside.
func TestKubernetesStoreNeedsTagExternal(t *testing.T) {
	t.Skip("the tests on a real kube-apiserver are built with -tags external: run make test (or hack/kube-env.sh, then go test -tags external)")
}
