package secretmanager

import (
	"context"
	"errors"
	"os"
	"path/filepath"
)

// MountedFiles is the workload source of file mode: "default" is the key pair in CertChain and
// Key, "ROOTCA" the roots in Root. Each is read again whenever its files change (Kubernetes
// "..data" swaps included), and a pair caught half-swapped keeps the last good one in service.
type MountedFiles struct {
	CertChain, Key, Root string
}

func (f *MountedFiles) start(env *sourceEnv) (func(context.Context) error, error) {
	if f.CertChain == "" || f.Key == "" || f.Root == "" {
		return nil, errors.New("mounted workload files need a certificate chain, a key and a root file")
	}
	deliver := func(name string) func(*Secret, error) {
		return func(s *Secret, err error) {
			if err != nil {
				env.fail(name, err)
				return
			}
			env.set(s)
		}
	}
	// The operator's own files: no directory restriction.
	env.files.add(&fileResource{name: WorkloadCertName, certChain: f.CertChain, key: f.Key, deliver: deliver(WorkloadCertName)})
	env.files.add(&fileResource{name: RootCertName, root: f.Root, deliver: deliver(RootCertName)})
	// The file loader does the work; this source only has to last as long as the manager.
	return func(ctx context.Context) error {
		<-ctx.Done()
		return nil
	}, nil
}

// MountedFilesIn is the three credential files of dir: cert-chain.pem, key.pem and root-cert.pem.
func MountedFilesIn(dir string) *MountedFiles {
	return &MountedFiles{
		CertChain: filepath.Join(dir, CertChainFile),
		Key:       filepath.Join(dir, KeyFile),
		Root:      filepath.Join(dir, RootCertFile),
	}
}

// CredentialFiles says which of the three credential files dir holds, by name.
func CredentialFiles(dir string) (present, missing []string) {
	for _, name := range []string{CertChainFile, KeyFile, RootCertFile} {
		if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
			present = append(present, name)
		} else {
			missing = append(missing, name)
		}
	}
	return present, missing
}
