package agent

// CARootCert exposes the CA root lookup to the tests.
func CARootCert(c Config) string { return c.caRootCert() }
