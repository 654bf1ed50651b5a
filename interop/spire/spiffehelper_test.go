//go:build external

package spire_test

import (
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/spiffe/go-spiffe/v2/bundle/jwtbundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/jwtsvid"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds/sdsclient"
)

// The files spiffe-helper writes in its cert_dir, as its configuration names them.
const (
	helperSVID      = "svid.pem"
	helperKey       = "svid_key.pem"
	helperBundle    = "svid_bundle.pem"
	helperJWT       = "jwt_svid.token"
	helperJWTBundle = "jwt_bundle.json"
	helperAudience  = "helper-test"
	helperExtraAud  = "helper-extra"
)

// helperRan is the line spiffe-helper's command prints once it has recorded a run: the command's
// stdout is spiffe-helper's.
const helperRan = "spiffe-helper-test: ran"

// helperConf writes a spiffe-helper configuration for socket and certDir, with extra HCL lines
// besides, and returns its path.
func helperConf(t *testing.T, socket, certDir string, extra ...string) string {
	t.Helper()
	lines := append([]string{
		fmt.Sprintf("agent_address = %q", socket),
		fmt.Sprintf("cert_dir = %q", certDir),
		fmt.Sprintf("svid_file_name = %q", helperSVID),
		fmt.Sprintf("svid_key_file_name = %q", helperKey),
		fmt.Sprintf("svid_bundle_file_name = %q", helperBundle),
	}, extra...)
	path := filepath.Join(t.TempDir(), "helper.conf")
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// helperFiles is what spiffe-helper wrote for an X.509-SVID.
type helperFiles struct {
	chain, bundle []*x509.Certificate
	keyPEM        []byte
}

func readHelperFiles(t *testing.T, dir string) helperFiles {
	t.Helper()
	read := func(name string) []byte {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	var f helperFiles
	var err error
	if f.chain, err = pki.ParseCertificates(read(helperSVID)); err != nil {
		t.Fatalf("%s: %v", helperSVID, err)
	}
	if f.bundle, err = pki.ParseCertificates(read(helperBundle)); err != nil {
		t.Fatalf("%s: %v", helperBundle, err)
	}
	f.keyPEM = read(helperKey)
	return f
}

// check checks that the files are an X.509-SVID of id alone, with its key, which the bundle
// verifies.
func (f helperFiles) check(t *testing.T, id string) {
	t.Helper()
	leaf := f.chain[0]
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != id {
		t.Errorf("the leaf of %s has URI SANs %v, want %s alone", helperSVID, leaf.URIs, id)
	}
	key, err := pki.ParsePrivateKey(f.keyPEM)
	if err != nil {
		t.Fatalf("%s: %v", helperKey, err)
	}
	if !pki.KeyMatchesCertificate(key, leaf) {
		t.Errorf("%s does not match the leaf of %s", helperKey, helperSVID)
	}
	roots, inter := x509.NewCertPool(), x509.NewCertPool()
	for _, c := range f.bundle {
		roots.AddCert(c)
	}
	for _, c := range f.chain[1:] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Errorf("%s does not verify %s: %v", helperBundle, helperSVID, err)
	}
}

// umask is this process's, which spiffe-helper inherits and its files' modes go through.
func umask(t *testing.T) fs.FileMode {
	t.Helper()
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "Umask:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32)
			if err != nil {
				t.Fatalf("/proc/self/status: Umask: %v", err)
			}
			return fs.FileMode(m)
		}
	}
	t.Fatal("/proc/self/status has no Umask line")
	return 0
}

// checkModes checks the files' permissions against want, less the umask.
func checkModes(t *testing.T, dir string, want map[string]fs.FileMode) {
	t.Helper()
	mask := umask(t)
	for name, mode := range want {
		info, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if got := info.Mode(); got != mode&^mask {
			t.Errorf("%s has mode %v, want %v (spiffe-helper's default %v, umask %03o)", name, got, mode&^mask, mode, mask)
		}
	}
}

// servedChains records every chain the agent's SDS pushes for the workload's certificate, as
// Envoy's stream would see them.
type servedChains struct {
	mu     sync.Mutex
	chains [][]*x509.Certificate
	grew   chan struct{} // closed and replaced at every push
	err    error         // why the stream ended, once it has
}

func followChains(t *testing.T, socket string) *servedChains {
	t.Helper()
	c, err := sdsclient.Dial(socket, sdsclient.WithNode(&corev3.Node{Id: nodeID}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &servedChains{grew: make(chan struct{})}
	done := make(chan struct{})
	go func() {
		defer close(done)
		err := c.Follow(ctx, []string{sdsclient.WorkloadCertName}, nil, func(r sdsclient.Response) error {
			chain, _, err := sdsclient.KeyPair(r.Secrets[sdsclient.WorkloadCertName])
			if err != nil {
				return err
			}
			s.mu.Lock()
			defer s.mu.Unlock()
			s.chains = append(s.chains, chain)
			close(s.grew)
			s.grew = make(chan struct{})
			return nil
		})
		s.mu.Lock()
		s.err = err
		close(s.grew)
		s.mu.Unlock()
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = c.Close()
	})
	return s
}

// awaitLatest waits for SDS to have pushed chain, which must then be the latest it pushed: the
// agent's current certificate.
func (s *servedChains) awaitLatest(t *testing.T, chain []*x509.Certificate) {
	t.Helper()
	deadline := time.After(wait)
	for {
		s.mu.Lock()
		at := slices.IndexFunc(s.chains, func(c []*x509.Certificate) bool { return sameCerts(c, chain) })
		n, grew, err := len(s.chains), s.grew, s.err
		s.mu.Unlock()
		switch {
		case at >= 0 && at == n-1:
			return
		case at >= 0:
			t.Fatalf("SDS pushed %d certificates after the one in %s: spiffe-helper's files are behind", n-1-at, helperSVID)
		case err != nil:
			t.Fatalf("the SDS stream ended: %v", err)
		}
		select {
		case <-grew:
		case <-deadline:
			t.Fatalf("SDS pushed no chain equal to %s followed by %s within %s (%d pushed)", helperSVID, helperBundle, wait, n)
		}
	}
}

// readRuns returns the lines of the file spiffe-helper's command appends to at each run.
func readRuns(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
}

// spiffe-helper in daemon mode against a single-workload agent whose certificates live 16 s:
// after each update it has written the agent's current SVID (the chain SDS serves as default,
// less the root, which is the bundle), its key and the trust bundle, with the modes it
// documents, and run its command; the next rotation rewrites the files with the new certificate
// and runs the command again, once. The JWT-SVID it asks for validates against the JWT bundle it
// wrote.
func TestSpiffeHelperWritesAndRenews(t *testing.T) {
	t.Parallel()
	helper := spiffeHelper(t)
	// 16 s lives, renewed at half: 8 s between rotations, for reading the files of one.
	_, socket := startAgent(t, "--secret-ttl", "16s", "--grace-period-ratio-jitter", "0")
	served := followChains(t, socket)

	dir := t.TempDir()
	certDir, runs := filepath.Join(dir, "certs"), filepath.Join(dir, "runs")
	if err := os.Mkdir(certDir, 0o700); err != nil {
		t.Fatal(err)
	}
	// The command records a checksum of the SVID file as it found it, then says so on stdout.
	script := fmt.Sprintf("cksum < %s >> %s && echo %s", filepath.Join(certDir, helperSVID), runs, helperRan)
	conf := helperConf(t, socket, certDir, append([]string{
		`cmd = "/bin/sh"`,
		fmt.Sprintf("cmd_args = %q", `-c "`+script+`"`),
	}, helperJWTConf()...)...)
	h := start(t, "spiffe-helper", helper, "-config", conf)
	isRun := func(l string) bool { return l == helperRan }

	ran := h.awaitLine(t, 0, "its command's first run", isRun)
	first := readHelperFiles(t, certDir)
	first.check(t, spiffeID)
	served.awaitLatest(t, append(slices.Clone(first.chain), first.bundle...))
	_, roots := sdsKeyPair(t, socket)
	if !sameCerts(first.bundle, roots) {
		t.Errorf("%s is not the roots SDS serves as %q", helperBundle, sdsclient.RootCertName)
	}
	checkModes(t, certDir, map[string]fs.FileMode{helperSVID: 0o644, helperKey: 0o600, helperBundle: 0o644})
	if got := readRuns(t, runs); len(got) != 1 {
		t.Fatalf("the command recorded %d runs, want 1: %q", len(got), got)
	}
	h.awaitLine(t, 0, "the JWT-SVID written", func(l string) bool { return strings.Contains(l, `msg="JWT SVID updated"`) })
	h.awaitLine(t, 0, "the JWT bundle written", func(l string) bool { return strings.Contains(l, `msg="JWT bundle updated"`) })
	checkHelperJWT(t, certDir, spiffeID, helperAudience, helperExtraAud)

	h.awaitLine(t, ran+1, "its command's run after a rotation", isRun)
	second := readHelperFiles(t, certDir)
	second.check(t, spiffeID)
	served.awaitLatest(t, append(slices.Clone(second.chain), second.bundle...))
	if second.chain[0].Equal(first.chain[0]) || !second.chain[0].NotAfter.After(first.chain[0].NotAfter) {
		t.Errorf("after a rotation %s holds the certificate with serial %x, expiring %v; want a new one expiring after %v",
			helperSVID, second.chain[0].SerialNumber, second.chain[0].NotAfter, first.chain[0].NotAfter)
	}
	if string(second.keyPEM) == string(first.keyPEM) {
		t.Error("after a rotation the key file is the same: the agent rotated the certificate, not the key")
	}
	// One run per rotation, each for a certificate of its own.
	if got := readRuns(t, runs); len(got) != 2 || got[0] == got[1] {
		t.Errorf("the command recorded %q, want two runs, each with a different %s", got, helperSVID)
	}
	if n := strings.Count(h.String(), "X.509 certificates updated"); n != 2 {
		t.Errorf("spiffe-helper updated its files %d times, want 2: once per certificate", n)
	}
}

// helperJWTConf has spiffe-helper write a JWT-SVID for helperAudience and helperExtraAud, and
// the JWT bundle. (With -daemon-mode=false it asks for helperAudience alone.)
func helperJWTConf() []string {
	return []string{
		fmt.Sprintf("jwt_bundle_file_name = %q", helperJWTBundle),
		fmt.Sprintf("jwt_svids = [{jwt_audience = %q, jwt_extra_audiences = [%q], jwt_svid_file_name = %q}]", helperAudience, helperExtraAud, helperJWT),
	}
}

// checkHelperJWT checks the JWT-SVID spiffe-helper wrote: of id, for the audiences aud, valid
// against the JWT bundle it wrote, both with the mode it documents, 0600.
func checkHelperJWT(t *testing.T, certDir, id string, aud ...string) {
	t.Helper()
	token, err := os.ReadFile(filepath.Join(certDir, helperJWT))
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(certDir, helperJWTBundle))
	if err != nil {
		t.Fatal(err)
	}
	// spiffe-helper's layout: trust domain name → the JWKS, base64.
	var bundles map[string]string
	if err := json.Unmarshal(data, &bundles); err != nil {
		t.Fatalf("%s: %v", helperJWTBundle, err)
	}
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	jwks, err := base64.StdEncoding.DecodeString(bundles[td.Name()])
	if err != nil {
		t.Fatalf("%s[%q]: %v", helperJWTBundle, td.Name(), err)
	}
	bundle, err := jwtbundle.Parse(td, jwks)
	if err != nil {
		t.Fatalf("%s[%q]: %v", helperJWTBundle, td.Name(), err)
	}
	svid, err := jwtsvid.ParseAndValidate(string(token), bundle, []string{helperAudience})
	if err != nil {
		t.Fatalf("%s against %s: %v", helperJWT, helperJWTBundle, err)
	}
	if svid.ID.String() != id {
		t.Errorf("%s is a JWT-SVID of %s, want %s", helperJWT, svid.ID, id)
	}
	// The agent asks for an audience set, sorted; aud's order means nothing (RFC 7519).
	if !slices.Equal(slices.Sorted(slices.Values(svid.Audience)), slices.Sorted(slices.Values(aud))) {
		t.Errorf("%s is for the audiences %q, want %q", helperJWT, svid.Audience, aud)
	}
	checkModes(t, certDir, map[string]fs.FileMode{helperJWT: 0o600, helperJWTBundle: 0o600})
}

// copyFile copies src to dst, executable.
func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = in.Close() }()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		_ = out.Close()
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

// In node mode (--workload-attestation) spiffe-helper is a workload like any other, known by
// the kernel: the copy a path rule names gets that rule's identity in its files, X.509 and JWT;
// a hard link to the same binary that no rule names is refused, says so in its log and writes
// nothing, and the agent logs whom it refused; once a rule names it too, the link, still
// running, gets that rule's identity.
func TestSpiffeHelperInNodeMode(t *testing.T) {
	t.Parallel()
	helper := spiffeHelper(t)
	// The rule names the path as /proc/PID/exe shows it: no symbolic link on the way.
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	attested, stranger := filepath.Join(dir, "attested"), filepath.Join(dir, "stranger")
	copyFile(t, helper, attested)
	if err := os.Link(attested, stranger); err != nil {
		t.Fatal(err)
	}
	const ruleID = "spiffe://cluster.local/ns/helper-ns/sa/helper-sa"
	rules := filepath.Join(dir, "rules.yaml")
	rule := fmt.Sprintf("  - {path: %q, uid: %d, namespace: helper-ns, serviceAccount: helper-sa}\n", attested, os.Getuid())
	writeRules(t, rules, rule)
	agent, socket := startAgent(t, "--workload-attestation", rules)

	// The stranger, in daemon mode, keeps asking; each answer is a refusal, which it logs.
	strangerCerts := filepath.Join(dir, "stranger-certs")
	if err := os.Mkdir(strangerCerts, 0o700); err != nil {
		t.Fatal(err)
	}
	s := start(t, "spiffe-helper (no rule)", stranger, "-config", helperConf(t, socket, strangerCerts))
	s.awaitLine(t, 0, "the refusal of its watch", func(l string) bool {
		return strings.Contains(l, "Error while watching x509 context") && strings.Contains(l, "code = PermissionDenied")
	})
	agent.awaitLine(t, 0, "the refusal of the stranger, naming its pid and executable", func(l string) bool {
		var rec map[string]any
		return json.Unmarshal([]byte(l), &rec) == nil && rec["msg"] == "workload attestation refused a caller" &&
			rec["reason"] == "no_rule" && strings.Contains(fmt.Sprint(rec["peer"]), fmt.Sprintf("pid=%d ", s.Pid)) &&
			strings.HasSuffix(fmt.Sprint(rec["peer"]), " exe="+stranger)
	})

	// The attested copy, run once (daemon mode off): it fetches, writes and exits.
	certs := filepath.Join(dir, "attested-certs")
	if err := os.Mkdir(certs, 0o700); err != nil {
		t.Fatal(err)
	}
	a := start(t, "spiffe-helper (path rule)", attested, "-daemon-mode=false", "-config", helperConf(t, socket, certs, helperJWTConf()...))
	if code, err := a.AwaitExit(wait); err != nil || code != 0 {
		t.Fatalf("spiffe-helper with -daemon-mode=false: exit %d (%v), want 0", code, err)
	}
	readHelperFiles(t, certs).check(t, ruleID)
	checkHelperJWT(t, certs, ruleID, helperAudience)

	if entries, err := os.ReadDir(strangerCerts); err != nil || len(entries) != 0 {
		t.Fatalf("the refused spiffe-helper wrote %v (%v), want nothing", entries, err)
	}

	// A rule for the stranger: the agent reloads the file, and the stranger's next try, which
	// go-spiffe makes within seconds, gets that rule's identity with no restart.
	const strangerID = "spiffe://cluster.local/ns/helper-ns/sa/stranger-sa"
	mark := agent.Mark()
	writeRules(t, rules, rule+fmt.Sprintf("  - {path: %q, uid: %d, namespace: helper-ns, serviceAccount: stranger-sa}\n", stranger, os.Getuid()))
	agent.awaitLine(t, mark, "the two rules loaded", func(l string) bool {
		var rec map[string]any
		return json.Unmarshal([]byte(l), &rec) == nil && rec["msg"] == "workload attestation rules loaded" && rec["kept"] == 2.0
	})
	s.awaitLine(t, 0, "its files written", func(l string) bool { return strings.Contains(l, `msg="X.509 certificates updated"`) })
	readHelperFiles(t, strangerCerts).check(t, strangerID)
}

// writeRules replaces the attestation rules file at path with rules, at once, as an editor
// saving it would.
func writeRules(t *testing.T, path string, rules ...string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte("rules:\n"+strings.Join(rules, "")), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}
