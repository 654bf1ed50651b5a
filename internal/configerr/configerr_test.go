package configerr_test

import (
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/configerr"
)

// flags names fields as a command would: a flag, and a variable after it.
type flags struct{}

func (flags) Name(field, value string) string {
	if value != "" {
		return "--" + field + "=" + value + " (ENV)"
	}
	return "--" + field + " (ENV)"
}

func (flags) Around(field string) (string, string) { return "--" + field, " (ENV)" }

func TestRender(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err         *configerr.FieldError
		paths, flag string
	}{
		{&configerr.FieldError{Field: "A.B", Err: errors.New("bad")}, "A.B: bad", "--A.B (ENV): bad"},
		{&configerr.FieldError{Field: "A.B", Value: "x", Err: errors.New("no port")}, `A.B "x": no port`, `--A.B "x" (ENV): no port`},
		{&configerr.FieldError{Field: "A.B", Value: time.Second, Err: configerr.ErrMustNotBeNegative}, "A.B 1s must not be negative", "--A.B (ENV) 1s must not be negative"},
		{configerr.Errorf("A.B", "{A.B} needs {C=false} and {D}"), "A.B needs C=false and D", "--A.B (ENV) needs --C=false (ENV) and --D (ENV)"},
		{configerr.Errorf("A.B", "something about {A.B}: %w", fs.ErrNotExist), "something about A.B: file does not exist", "something about --A.B (ENV): file does not exist"},
		{&configerr.FieldError{Field: "A", Err: errors.New("needs {B}, not {json}")}, "A: needs B, not {json}", "--A (ENV): needs --B (ENV), not {json}"},
	} {
		if got := tc.err.Error(); got != tc.paths {
			t.Errorf("Error() = %q, want %q", got, tc.paths)
		}
		if got := tc.err.Render(flags{}); got != tc.flag {
			t.Errorf("Render() = %q, want %q", got, tc.flag)
		}
	}
}

// Every FieldError of a joined or wrapped error is found, with the fields its message names.
func TestAllAndFields(t *testing.T) {
	t.Parallel()
	a := configerr.Errorf("A", "{A} needs {B.C}")
	b := &configerr.FieldError{Field: "D", Err: errors.New("bad")}
	err := errors.Join(fmt.Errorf("wrapped: %w", a), errors.New("plain"), b)
	if got := configerr.All(err); len(got) != 2 || got[0] != a || got[1] != b {
		t.Fatalf("All = %v", got)
	}
	if got := configerr.Fields(err); !slices.Equal(got, []string{"A", "A", "B.C", "D"}) {
		t.Fatalf("Fields = %v", got)
	}
	if !errors.Is(configerr.Errorf("A", "{A}: %w", fs.ErrNotExist), fs.ErrNotExist) {
		t.Fatal("the cause is not wrapped")
	}
}
