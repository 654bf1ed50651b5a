package attest

import "sync"

// maxLoggedCallers bounds the refused callers remembered, so that a refusal is logged once per
// process and reason however many processes are refused.
const maxLoggedCallers = 1024

// recentKey is one process (a pid and its start time) refused for one reason.
type recentKey struct {
	pid    int32
	start  uint64
	reason string
}

// recentSet remembers the last keys added, forgetting the oldest past its size.
type recentSet struct {
	mu    sync.Mutex
	size  int
	keys  map[recentKey]struct{}
	order []recentKey // oldest first
}

func newRecentSet(size int) *recentSet {
	return &recentSet{size: size, keys: make(map[recentKey]struct{}, size)}
}

// add reports whether k was new.
func (s *recentSet) add(k recentKey) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.keys[k]; ok {
		return false
	}
	if len(s.order) == s.size {
		delete(s.keys, s.order[0])
		s.order = s.order[1:]
	}
	s.keys[k] = struct{}{}
	s.order = append(s.order, k)
	return true
}
