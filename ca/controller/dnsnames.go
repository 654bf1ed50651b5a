package controller

import (
	"fmt"
	"strings"
)

// citadelWebhooks are the service accounts whose secrets Citadel gives the DNS names of their
// webhook services in the CA's namespace (its --append-dns-names).
func citadelWebhooks() map[string]string {
	return map[string]string{
		"istio-sidecar-injector-service-account": "istio-sidecar-injector",
		"istio-galley-service-account":           "istio-galley",
	}
}

// DNSNames builds SecretsConfig.DNSNames as Citadel does with --append-dns-names: the webhook
// service accounts in caNamespace get <service>.<ns>.svc and <service>.<ns>, then every entry of
// custom ("<sa>.<ns>:<dns>,…", Citadel's --custom-dns-names) adds its name to that service
// account's secret, in order. Citadel skips a malformed entry silently; here it is an error.
func DNSNames(caNamespace, custom string) (map[string][]string, error) {
	out := map[string][]string{}
	for sa, svc := range citadelWebhooks() {
		out[sa+"."+caNamespace] = []string{svc + "." + caNamespace + ".svc", svc + "." + caNamespace}
	}
	if custom == "" {
		return out, nil
	}
	for entry := range strings.SplitSeq(custom, ",") {
		account, name, ok := strings.Cut(entry, ":")
		if !ok || strings.Contains(name, ":") {
			return nil, fmt.Errorf("custom DNS name %q: want <service account>.<namespace>:<DNS name>", entry)
		}
		// A namespace has no dot; a service account may.
		i := strings.LastIndex(account, ".")
		if i <= 0 || i == len(account)-1 {
			return nil, fmt.Errorf("custom DNS name %q: %q is not <service account>.<namespace>", entry, account)
		}
		if !validDNSName(name) {
			return nil, fmt.Errorf("custom DNS name %q: %q is not a DNS name", entry, name)
		}
		out[account] = append(out[account], name)
	}
	return out, nil
}

func validDNSName(name string) bool {
	name = strings.TrimPrefix(name, "*.")
	if name == "" || len(name) > 253 {
		return false
	}
	for label := range strings.SplitSeq(name, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, r := range label {
			if !isHostnameRune(r) {
				return false
			}
		}
	}
	return true
}

func isHostnameRune(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-'
}
