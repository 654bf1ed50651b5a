package testutil

import (
	"go/ast"
	"go/parser"
	"go/token"
	"strconv"
	"strings"
	"testing"
)

// StringLiterals returns the string literals of the Go file at path that contain any of substrs:
// fuzz seeds taken from what a package's tests already spell out, rather than copied.
func StringLiterals(t testing.TB, path string, substrs ...string) []string {
	t.Helper()
	file, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	ast.Inspect(file, func(n ast.Node) bool {
		lit, ok := n.(*ast.BasicLit)
		if !ok || lit.Kind != token.STRING {
			return true
		}
		s, err := strconv.Unquote(lit.Value)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		for _, sub := range substrs {
			if strings.Contains(s, sub) {
				out = append(out, s)
				break
			}
		}
		return true
	})
	return out
}
