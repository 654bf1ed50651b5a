package attest

import (
	"strings"
	"testing"
)

func TestParseRules(t *testing.T) {
	t.Parallel()
	file := `
rules:
- {uid: 65534, namespace: default, serviceAccount: app}
- {uid: 1000, namespace: Default, serviceAccount: app}     # 1: namespace not a DNS label
- {gid: 20, serviceAccount: app}                            # 2: no namespace
- {gid: 20, namespace: ns}                                  # 3: no service account
- {namespace: ns, serviceAccount: sa}                       # 4: no selector
- {uid: "x", namespace: ns, serviceAccount: sa}             # 5: not a number
- {uid: -1, namespace: ns, serviceAccount: sa}              # 6: out of range
- {path: bin/app, namespace: ns, serviceAccount: sa}        # 7: relative path
- {path: /usr/bin/../bin/app, namespace: ns, serviceAccount: sa} # 8: not clean
- {cgroup: "system.slice", namespace: ns, serviceAccount: sa}    # 9: not absolute
- {cgroup: "/[", namespace: ns, serviceAccount: sa}         # 10: bad pattern
- {podUID: nope, namespace: ns, serviceAccount: sa}         # 11: not a pod uid
- {uid: 1, namespace: ns, serviceAcount: sa}                # 12: misspelt field
- null                                                      # 13
- {podUID: "4a2c6f4e-8b1d-4f7e-9c3a-2d5e6f7a8b9c.slice", namespace: ns, serviceAccount: sa} # 14
- {gid: 20, path: /usr/bin/app, cgroup: /system.slice/app.service, podUID: 4A2C6F4E_8B1D_4F7E_9C3A_2D5E6F7A8B9C, namespace: web, serviceAccount: front.end}
`
	rules, bad, err := ParseRules([]byte(file))
	if err != nil {
		t.Fatal(err)
	}
	if len(rules) != 2 || rules[0].Namespace != "default" || *rules[0].UID != 65534 || rules[1].ServiceAccount != "front.end" {
		t.Fatalf("rules = %+v, want the first and the last", rules)
	}
	if rules[1].PodUID != podUID {
		t.Errorf("podUID = %q, want it as the API server writes it, %q", rules[1].PodUID, podUID)
	}
	wantBad := map[int]string{
		1: "namespace", 2: "namespace is required", 3: "serviceAccount is required", 4: "no selector",
		5: "cannot unmarshal", 6: "cannot unmarshal", 7: "absolute", 8: "clean", 9: "starts with /",
		10: "syntax error", 11: "pod UID", 12: "unknown field", 13: "namespace is required", 14: "pod UID",
	}
	if len(bad) != len(wantBad) {
		t.Fatalf("bad rules = %v, want %d of them", bad, len(wantBad))
	}
	for _, b := range bad {
		if want, ok := wantBad[b.Index]; !ok || !strings.Contains(b.Err.Error(), want) {
			t.Errorf("bad rule %d: %v, want %q", b.Index, b.Err, want)
		}
	}
}

func TestParseRulesFileErrors(t *testing.T) {
	t.Parallel()
	for _, file := range []string{"rules: [", "rules: {uid: 1}", "rulez: []", "- a\n- b\n"} {
		if _, _, err := ParseRules([]byte(file)); err == nil {
			t.Errorf("ParseRules(%q) accepted", file)
		}
	}
	rules, bad, err := ParseRules(nil)
	if err != nil || len(rules) != 0 || len(bad) != 0 {
		t.Errorf("an empty file: %v, %v, %v; want no rules", rules, bad, err)
	}
}

func mustRules(t *testing.T, file string) []Rule {
	t.Helper()
	rules, bad, err := ParseRules([]byte(file))
	if err != nil || len(bad) != 0 {
		t.Fatalf("ParseRules: %v, bad %v", err, bad)
	}
	return rules
}

// first returns the identity of the first rule that matches p, as Identify tries them.
func first(rules []Rule, p Process) (Identity, bool) {
	for _, r := range rules {
		if r.matches(p) {
			return r.identity(), true
		}
	}
	return Identity{}, false
}

func TestRuleMatching(t *testing.T) {
	t.Parallel()
	rules := mustRules(t, `
rules:
- {uid: 1000, path: /usr/bin/web, namespace: web, serviceAccount: web}
- {uid: 1000, namespace: users, serviceAccount: u1000}
- {gid: 33, namespace: www, serviceAccount: data}
- {podUID: `+podUID+`, namespace: shop, serviceAccount: cart}
- {cgroup: /system.slice/db.service, namespace: db, serviceAccount: postgres}
- {cgroup: "/kubepods.slice/*/kubepods-besteffort-pod*.slice", namespace: batch, serviceAccount: job}
`)
	podCgroup := "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podUIDSnake + ".slice/cri-containerd-" + containerID + ".scope"
	for _, tc := range []struct {
		name string
		p    Process
		want Identity
		ok   bool
	}{
		{name: "uid and path: the first rule", p: Process{UID: 1000, Exe: "/usr/bin/web"}, want: Identity{"web", "web"}, ok: true},
		{name: "uid alone: the path selector fails the first, the second matches", p: Process{UID: 1000, Exe: "/usr/bin/other"}, want: Identity{"users", "u1000"}, ok: true},
		{name: "path alone is not enough (AND)", p: Process{UID: 1001, Exe: "/usr/bin/web"}},
		{name: "primary gid", p: Process{UID: 5, GID: 33}, want: Identity{"www", "data"}, ok: true},
		{name: "supplementary gid", p: Process{UID: 5, GID: 5, Groups: []uint32{4, 33}}, want: Identity{"www", "data"}, ok: true},
		{name: "pod uid before the cgroup glob", p: Process{UID: 5, PodUID: podUID, Cgroups: []string{podCgroup}}, want: Identity{"shop", "cart"}, ok: true},
		{name: "cgroup glob", p: Process{UID: 5, PodUID: "other", Cgroups: []string{podCgroup}}, want: Identity{"batch", "job"}, ok: true},
		{name: "cgroup prefix on whole segments", p: Process{UID: 5, Cgroups: []string{"/system.slice/db.service/worker"}}, want: Identity{"db", "postgres"}, ok: true},
		{name: "cgroup prefix is not a string prefix", p: Process{UID: 5, Cgroups: []string{"/system.slice/db.service-evil"}}},
		{name: "any of the v1 hierarchies", p: Process{UID: 5, Cgroups: []string{"/", "/system.slice/db.service"}}, want: Identity{"db", "postgres"}, ok: true},
		{name: "nothing", p: Process{UID: 5, GID: 5, Exe: "/bin/sh", Cgroups: []string{"/user.slice"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, ok := first(rules, tc.p)
			if ok != tc.ok || got != tc.want {
				t.Fatalf("matched %v %v, want %v %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}
