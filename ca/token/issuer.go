package token

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// Defaults of an Issuer.
const (
	// DefaultJWKSRefreshInterval is istiod's (PILOT_JWT_PUB_KEY_REFRESH_INTERVAL).
	DefaultJWKSRefreshInterval = 20 * time.Minute
	// MinJWKSFetchInterval bounds the fetches a token naming an unknown kid can cause: at most
	// one a minute per issuer, whatever clients send.
	MinJWKSFetchInterval = time.Minute
)

// ErrNoIssuerKeys reports a token of an external issuer whose keys have never been fetched: the
// token may be good, and the caller should retry.
var ErrNoIssuerKeys = errors.New("the issuer's keys have not been fetched yet")

// JWKSFetcher fetches an issuer's JWKS document.
type JWKSFetcher func(ctx context.Context) ([]byte, error)

// IssuerConfig configures an Issuer.
type IssuerConfig struct {
	Rule  Rule
	Fetch JWKSFetcher
	// RefreshInterval is how often the JWKS is fetched; 0: DefaultJWKSRefreshInterval.
	RefreshInterval time.Duration
	Leeway          time.Duration // 0: DefaultLeeway
	Clock           clock.Clock   // nil: the real clock
	Logger          *slog.Logger  // nil: discard
	// OnRefresh, when set, is told of every fetch's outcome.
	OnRefresh func(ok bool)
}

// Issuer verifies the tokens of one external issuer (a Rule) with the keys it fetches from the
// issuer's JWKS URL: at Run's start, every RefreshInterval, and when a token names a kid it does
// not hold (at most once per MinJWKSFetchInterval). A failed fetch keeps the last good keys.
type Issuer struct {
	cfg    IssuerConfig
	parser *jwt.Parser

	fetchMu sync.Mutex // one fetch at a time
	mu      sync.Mutex
	keys    *KeySet
	// lastFetch is when the last fetch began; zero before the first.
	lastFetch time.Time
	// fetches counts the fetches ended, so that a caller that waited for another's fetch knows.
	fetches uint64
}

// NewIssuer returns an Issuer for a rule ValidateRules accepted. It fetches nothing: Run does.
func NewIssuer(cfg IssuerConfig) (*Issuer, error) {
	if err := cfg.Rule.validate(); err != nil {
		return nil, fmt.Errorf("issuer %q: %w", cfg.Rule.Issuer, err)
	}
	if cfg.Fetch == nil {
		return nil, errors.New("an issuer needs a JWKS fetcher")
	}
	if cfg.RefreshInterval <= 0 {
		cfg.RefreshInterval = DefaultJWKSRefreshInterval
	}
	if cfg.Leeway == 0 {
		cfg.Leeway = DefaultLeeway
	}
	cfg.Clock = clock.OrReal(cfg.Clock)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	parser := jwt.NewParser(
		jwt.WithValidMethods(allowedAlgorithms()),
		jwt.WithAudience(cfg.Rule.Audiences...), // any of them
		jwt.WithIssuer(cfg.Rule.Issuer),
		jwt.WithExpirationRequired(),
		jwt.WithLeeway(cfg.Leeway),
		jwt.WithStrictDecoding(),
		jwt.WithTimeFunc(cfg.Clock.Now),
	)
	return &Issuer{cfg: cfg, parser: parser}, nil
}

// Name returns the issuer (the iss of its tokens).
func (i *Issuer) Name() string { return i.cfg.Rule.Issuer }

// Run fetches the keys now and every RefreshInterval until ctx ends. A failed fetch is logged
// and counted, and the last good keys stay.
func (i *Issuer) Run(ctx context.Context) error {
	for {
		_ = i.Refresh(ctx)
		t := i.cfg.Clock.NewTimer(i.cfg.RefreshInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C():
		}
	}
}

// Refresh fetches and parses the JWKS, replacing the keys when it succeeds.
func (i *Issuer) Refresh(ctx context.Context) error {
	i.fetchMu.Lock()
	defer i.fetchMu.Unlock()
	return i.refreshLocked(ctx)
}

func (i *Issuer) refreshLocked(ctx context.Context) error {
	i.mu.Lock()
	i.lastFetch = i.cfg.Clock.Now()
	i.mu.Unlock()
	defer func() {
		i.mu.Lock()
		i.fetches++ // ended, well or not
		i.mu.Unlock()
	}()
	data, err := i.cfg.Fetch(ctx)
	var keys *KeySet
	if err == nil {
		keys, err = ParseKeySet(data)
	}
	if err != nil {
		if ctx.Err() != nil {
			return err // stopping, not failing
		}
		i.report(false)
		i.mu.Lock()
		held := 0
		if i.keys != nil {
			held = i.keys.Len()
		}
		i.mu.Unlock()
		i.cfg.Logger.Warn("cannot refresh the token issuer's keys; keeping the last good ones",
			logkey.Issuer, i.Name(), logkey.URL, i.cfg.Rule.JWKSURI, logkey.Keys, held, logkey.Error, err)
		return fmt.Errorf("issuer %q keys: %w", i.Name(), err)
	}
	i.report(true)
	i.mu.Lock()
	i.keys = keys
	i.mu.Unlock()
	i.cfg.Logger.Debug("token issuer keys refreshed", logkey.Issuer, i.Name(), logkey.Keys, keys.Len())
	return nil
}

func (i *Issuer) report(ok bool) {
	if i.cfg.OnRefresh != nil {
		i.cfg.OnRefresh(ok)
	}
}

// refreshForUnknownKey fetches the keys again if the last fetch began at least
// MinJWKSFetchInterval ago, and reports whether the keys may have changed since the caller
// looked: it fetched them, or another fetch ended while it waited for it.
func (i *Issuer) refreshForUnknownKey(ctx context.Context, before uint64) bool {
	i.fetchMu.Lock()
	defer i.fetchMu.Unlock()
	i.mu.Lock()
	waited := i.fetches != before
	due := i.lastFetch.IsZero() || i.cfg.Clock.Now().Sub(i.lastFetch) >= MinJWKSFetchInterval
	i.mu.Unlock()
	if waited {
		return true
	}
	if !due {
		return false
	}
	return i.refreshLocked(ctx) == nil
}

// currentKeys returns the keys and the number of fetches ended when they were read.
func (i *Issuer) currentKeys() (*KeySet, uint64) {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.keys, i.fetches
}

// Verify checks raw against the issuer's keys, the rule's audiences and the validity window,
// and maps it to a namespace and service account by the rule. A token naming a kid the issuer
// does not hold makes it fetch its keys again (rate-limited) and try once more. Errors wrap
// golang-jwt's, ErrUnknownKey, ErrNoKeyID, ErrSubject, ErrIdentityClaims or ErrNoIssuerKeys.
func (i *Issuer) Verify(ctx context.Context, raw string) (namespace, serviceAccount string, err error) {
	keys, fetches := i.currentKeys()
	claims, err := i.verify(keys, raw)
	if errors.Is(err, ErrUnknownKey) || errors.Is(err, ErrNoIssuerKeys) {
		if i.refreshForUnknownKey(ctx, fetches) {
			keys, _ = i.currentKeys()
			claims, err = i.verify(keys, raw)
		}
	}
	if err != nil {
		return "", "", err
	}
	return i.cfg.Rule.serviceAccount(claims)
}

func (i *Issuer) verify(keys *KeySet, raw string) (*ruleClaims, error) {
	if keys == nil {
		return nil, fmt.Errorf("%w (issuer %q)", ErrNoIssuerKeys, i.Name())
	}
	claims := &ruleClaims{}
	v := &Verifier{keys: keys}
	if _, err := i.parser.ParseWithClaims(raw, claims, v.keyFor); err != nil {
		return nil, err
	}
	return claims, nil
}

// UnverifiedIssuer returns raw's iss claim, unverified: only to pick the rule that verifies it.
func UnverifiedIssuer(raw string) (string, bool) {
	claims := &jwt.RegisteredClaims{}
	if _, _, err := jwt.NewParser().ParseUnverified(raw, claims); err != nil {
		return "", false
	}
	return claims.Issuer, claims.Issuer != ""
}
