package caclient_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// A root file is refused, saying why, unless it holds PEM certificates.
func TestCheckRootFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	for _, tc := range []struct {
		path, want string
	}{
		{write("root.pem", pki.EncodeCertificate(root.Cert)), ""},
		{filepath.Join(dir, "missing.pem"), "does not exist (only the default may be absent)"},
		{dir, "cannot be read"},
		{write("notes.txt", []byte("notes")), "holds no PEM certificate"},
		{write("bad.pem", []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")), "holds a certificate that does not parse"},
	} {
		err := caclient.CheckRootFile(tc.path, "only the default may be absent")
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.want)) {
			t.Errorf("%s: %v, want %q", tc.path, err, tc.want)
		}
	}
}
