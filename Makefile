# meshid build, test and benchmark targets. Only Go is required; `make test` is what CI runs.

GO        ?= go
PKGS      ?= ./...
BIN       ?= bin
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
LDFLAGS   := -s -w -X github.com/meshid/meshid/internal/version.version=$(VERSION)
# grpcnotrace drops golang.org/x/net/trace (and html/template with it) from the binaries.
TAGS      := grpcnotrace
FUZZTIME  ?= 30s
# How long the fuzzer may shrink each new input. Go's default, 60s, spends a short run's whole
# FUZZTIME shrinking the first inputs that find new coverage; 100x is a hundred tries each.
FUZZMINIMIZETIME ?= 100x
BENCHTIME ?= 3s
BENCHOUT  ?= bench.out
# The images' names (make images, make manifests): $(REGISTRY)/meshid{,-agent,-proxy}:$(TAG).
REGISTRY  ?= ghcr.io/meshid
TAG       ?= $(VERSION)
PUSH      ?= 0
DOCKER    ?= docker
MANIFESTS ?= deploy/kubernetes

# Fuzz targets, as package:Target.
FUZZ_TARGETS := ./ca:FuzzCheckCSR ./ca:FuzzLoadCACerts ./ca/token:FuzzVerify \
                ./secretmanager:FuzzParseFileResource ./sds:FuzzStreamRequests \
                ./discovery:FuzzParseConfig ./ca/controller:FuzzManifestFile ./ca/token:FuzzParseKeySet \
                ./internal/pki:FuzzParseCertificates ./internal/pki:FuzzParsePrivateKey ./internal/pki:FuzzParsePublicKeys

.PHONY: all build test vet race bench fuzz lint clean kube-env istio-env spire-env spiffe-helper-env chaos images manifests

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -tags '$(TAGS)' -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/...

# The Dockerfile's three images (meshid, agent, proxy) under $(REGISTRY) and $(TAG); PUSH=1 pushes
# them once all three built. DOCKER=podman works too.
images:
	@REGISTRY='$(REGISTRY)' TAG='$(TAG)' PUSH='$(PUSH)' DOCKER='$(DOCKER)' VERSION='$(VERSION)' hack/images.sh

# The manifests of $(MANIFESTS) with those image names, for kubectl apply -f -.
manifests:
	@REGISTRY='$(REGISTRY)' TAG='$(TAG)' VERSION='$(VERSION)' hack/manifests.sh $(MANIFESTS)

vet:
	$(GO) vet -tags external $(PKGS)

# Unit, integration and fuzz-seed tests under the race detector, and with -tags external the ones
# that need binaries from outside: the Kubernetes ones against a real kube-apiserver and etcd
# (built once by hack/kube-env.sh into a cache outside the repo), the Istio interoperability ones
# against a real pilot-agent (built once by hack/istio-env.sh), and the Workload API ones against
# SPIRE's own client, spire-agent's api commands (built once by hack/spire-env.sh), and against
# spiffe-helper (built once by hack/spiffe-helper-env.sh). A plain
# go test ./... runs the rest. atexit_sleep_ms=0: the race detector's default one-second wait at
# exit, per test binary, buys nothing here.
test: vet
	@bin=$$(hack/kube-env.sh) && istio=$$(hack/istio-env.sh) && spire=$$(hack/spire-env.sh) && \
	helper=$$(hack/spiffe-helper-env.sh) && \
	MESHID_KUBE_BIN=$$bin MESHID_ISTIO_BIN=$$istio MESHID_SPIRE_BIN=$$spire MESHID_SPIFFE_HELPER_BIN=$$helper GORACE=atexit_sleep_ms=0 $(GO) test -race -count=1 -tags external $(PKGS)

# The fault suite's long form (e2e/chaos_test.go): more kills, longer outages, more rotations.
# Its short form runs in `make test`.
chaos:
	GORACE=atexit_sleep_ms=0 $(GO) test -race -count=1 -timeout 20m -run 'Chaos' ./e2e/ -args -chaos.long

# Builds (or finds, when cached) the kube-apiserver and etcd the Kubernetes tests run.
kube-env:
	hack/kube-env.sh

# Builds (or finds, when cached) the pilot-agent the Istio interoperability tests run.
istio-env:
	hack/istio-env.sh

# Builds (or finds, when cached) the spire-agent whose api commands test the Workload API.
spire-env:
	hack/spire-env.sh

# Builds (or finds, when cached) the spiffe-helper that writes the Workload API's SVIDs to files.
spiffe-helper-env:
	hack/spiffe-helper-env.sh

# Go benchmarks; results go to $(BENCHOUT). See BENCHMARKS.md for the recorded figures. The
# rotation benchmark runs Istio's pilot-agent beside meshid-agent (built once by hack/istio-env.sh);
# a plain go test -bench skips that half and says so.
bench:
	@istio=$$(hack/istio-env.sh) && \
	MESHID_ISTIO_BIN=$$istio $(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) $(PKGS) | tee $(BENCHOUT)

# Runs each fuzz target for $(FUZZTIME).
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t##*:}; \
		echo "== $$name ($$pkg, $(FUZZTIME))"; \
		$(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZETIME) $$pkg; \
	done

# golangci-lint with the repository's .golangci.yml (depguard, gochecknoglobals, reassign, ...).
lint:
	$(GO) run github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0 run $(PKGS)

clean:
	rm -rf $(BIN) $(BENCHOUT)
