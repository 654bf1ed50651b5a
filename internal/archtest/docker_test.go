package archtest

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The image build context never carries what the README's commands leave in the working tree:
// those directories hold private keys and tokens.
func TestDockerBuildContextLeavesKeysOut(t *testing.T) {
	t.Parallel()
	readme := read(t, "README.md")
	var produced []string
	for _, m := range regexp.MustCompile(`(?:--root-dir|--state-dir|--output-certs|-o) \./([\w.-]+)`).FindAllStringSubmatch(readme, -1) {
		produced = append(produced, m[1])
	}
	if len(produced) < 3 {
		t.Fatalf("found only %v in the README's commands", produced)
	}
	var patterns []string
	for line := range strings.Lines(read(t, ".dockerignore")) {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			patterns = append(patterns, strings.TrimSuffix(line, "/"))
		}
	}
	for _, p := range produced {
		ignored := false
		for _, pat := range patterns {
			if ok, _ := filepath.Match(pat, p); ok {
				ignored = true
			}
		}
		if !ignored {
			t.Errorf(".dockerignore does not leave out ./%s, which the README's commands create", p)
		}
	}
}

// The images run as the non-root user, which must own what the default paths write, and the CA's
// state is a volume.
func TestDockerImagesRunAsNonRoot(t *testing.T) {
	t.Parallel()
	df := read(t, "Dockerfile")
	for _, want := range []string{
		"VOLUME /var/lib/meshid",
		"--chown=65532:65532 /out/root/var/lib/meshid /var/lib/meshid",
		"--chown=65532:65532 /out/root/var/run/secrets/workload-spiffe-uds /var/run/secrets/workload-spiffe-uds",
	} {
		if !strings.Contains(df, want) {
			t.Errorf("the Dockerfile lacks %q", want)
		}
	}
	if n := strings.Count(df, "USER 65532:65532"); n != 2 {
		t.Errorf("%d images run as the non-root user, want both", n)
	}
}

func read(t *testing.T, name string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}
