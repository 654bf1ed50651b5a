package main

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/controlplane"
)

const readmePath = "../../README.md"

// readmeRow is one row of a README table: its cells by column name, and its line for messages.
type readmeRow struct {
	line  int
	cells map[string]string
}

// readmeTable returns the rows of the one table under header in README's section heading (a
// "## " line, up to the next one).
func readmeTable(t *testing.T, readme, heading string, header []string) []readmeRow {
	t.Helper()
	lines := strings.Split(readme, "\n")
	start := slices.Index(lines, heading)
	if start < 0 {
		t.Fatalf("%s: no section %q", readmePath, heading)
	}
	var rows []readmeRow
	tables := 0
	for i := start + 1; i < len(lines) && !strings.HasPrefix(lines[i], "## "); i++ {
		if !strings.HasPrefix(lines[i], "|") || !slices.Equal(tableCells(lines[i]), header) {
			continue
		}
		tables++
		// Skip the header and the |---| line under it.
		for i += 2; i < len(lines) && strings.HasPrefix(lines[i], "|"); i++ {
			cells := tableCells(lines[i])
			if len(cells) != len(header) {
				t.Errorf("%s:%d: %d cells, want %d (%s)", readmePath, i+1, len(cells), len(header), strings.Join(header, ", "))
				continue
			}
			row := readmeRow{line: i + 1, cells: map[string]string{}}
			for j, name := range header {
				row.cells[name] = cells[j]
			}
			rows = append(rows, row)
		}
	}
	if tables != 1 {
		t.Fatalf("%s: section %q has %d tables headed | %s |, want 1", readmePath, heading, tables, strings.Join(header, " | "))
	}
	return rows
}

// tableCells splits a Markdown table row into its trimmed cells; a | inside backticks or
// escaped (\|) is text.
func tableCells(line string) []string {
	line = strings.TrimSpace(line)
	line = strings.TrimPrefix(line, "|")
	var cells []string
	var cell strings.Builder
	code := false
	for i := 0; i < len(line); i++ {
		switch c := line[i]; {
		case c == '\\' && i+1 < len(line) && line[i+1] == '|':
			cell.WriteByte('|')
			i++
		case c == '`':
			code = !code
			cell.WriteByte(c)
		case c == '|' && !code:
			cells = append(cells, strings.TrimSpace(cell.String()))
			cell.Reset()
		default:
			cell.WriteByte(c)
		}
	}
	if rest := strings.TrimSpace(cell.String()); rest != "" {
		cells = append(cells, rest)
	}
	return cells
}

var codeSpan = regexp.MustCompile("`([^`]*)`")

// codeSpans returns the backticked spans of s.
func codeSpans(s string) []string {
	var spans []string
	for _, m := range codeSpan.FindAllStringSubmatch(s, -1) {
		spans = append(spans, m[1])
	}
	return spans
}

// flagNames returns the flags a cell names: its backticked spans that start with --.
func flagNames(cell string) []string {
	var names []string
	for _, span := range codeSpans(cell) {
		if name, ok := strings.CutPrefix(span, "--"); ok && name != "" {
			names = append(names, strings.Fields(name)[0])
		}
	}
	return names
}

// isGroupRow says whether row is a group's title: bold text in the first column, nothing else.
func isGroupRow(row readmeRow, header []string) bool {
	first := row.cells[header[0]]
	if len(first) < 5 || !strings.HasPrefix(first, "**") || !strings.HasSuffix(first, "**") {
		return false
	}
	for _, name := range header[1:] {
		if row.cells[name] != "" {
			return false
		}
	}
	return true
}

// zeroDefault says whether pflag shows no default for value: --help then shows none, and the
// table may say what the empty value means instead.
func zeroDefault(value string) bool {
	switch value {
	case "", "false", "0", "0s", "[]":
		return true
	}
	return false
}

// commandFlags returns cmd's own flags by name: not --help, nor the globals every command has.
func commandFlags(cmd *cobra.Command) map[string]*pflag.Flag {
	flags := map[string]*pflag.Flag{}
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name != "help" && cmd.Root().PersistentFlags().Lookup(f.Name) == nil {
			flags[f.Name] = f
		}
	})
	return flags
}

// checkFlagTable reports the differences between rows and flags: a flag with no row or with
// several, a row naming no flag or one the command lacks, a default other than --help's.
// Each row's flags are returned, by row.
func checkFlagTable(t *testing.T, command string, rows []readmeRow, header []string, flagColumn string, flags map[string]*pflag.Flag) map[int][]string {
	t.Helper()
	rowFlags := map[int][]string{}
	seen := map[string]int{}
	for _, row := range rows {
		if isGroupRow(row, header) {
			continue
		}
		names := flagNames(row.cells[flagColumn])
		if len(names) == 0 {
			t.Errorf("%s:%d: the row of %s names no flag in its %s column: %q", readmePath, row.line, command, flagColumn, row.cells[flagColumn])
		}
		for _, name := range names {
			f, ok := flags[name]
			if !ok {
				t.Errorf("%s:%d: --%s is not a flag of %s", readmePath, row.line, name, command)
				continue
			}
			if line, dup := seen[name]; dup {
				t.Errorf("%s:%d: --%s already has a row, line %d", readmePath, row.line, name, line)
			}
			seen[name] = row.line
			if !zeroDefault(f.DefValue) && !slices.Contains(codeSpans(row.cells["default"]), f.DefValue) {
				t.Errorf("%s:%d: the default of --%s is `%s` in %s --help, not in %q", readmePath, row.line, name, f.DefValue, command, row.cells["default"])
			}
		}
		rowFlags[row.line] = names
	}
	var missing []string
	for name := range flags {
		if _, ok := seen[name]; !ok {
			missing = append(missing, "--"+name)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		t.Errorf("%s: %s has no row for %s", readmePath, command, strings.Join(missing, ", "))
	}
	return rowFlags
}

func readme(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(readmePath)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func rootForREADME() *cobra.Command {
	return newRootCommand(func(context.Context, controlplane.Config) error { return nil },
		func(context.Context, agent.Config) error { return nil },
		func(string) (string, bool) { return "", false }, nil)
}

func subcommand(t *testing.T, root *cobra.Command, name string) *cobra.Command {
	t.Helper()
	cmd, _, err := root.Find([]string{name})
	if err != nil || cmd.Name() != name {
		t.Fatalf("no %s command: %v", name, err)
	}
	return cmd
}

// README's table of `meshid agent` has a row for every flag, with the variable that sets it
// (cli.AgentVariables) and the default --help shows; meshid-agent's agent has the same flags.
func TestREADMEAgentTable(t *testing.T) {
	t.Parallel()
	header := []string{"variable", "flag", "default", "meaning"}
	rows := readmeTable(t, readme(t), "## `meshid agent`", header)
	agentCmd := subcommand(t, rootForREADME(), "agent")
	flags := commandFlags(agentCmd)
	rowFlags := checkFlagTable(t, "meshid agent", rows, header, "flag", flags)

	variables := cli.AgentVariables()
	for flag := range variables {
		if _, ok := flags[flag]; !ok {
			t.Errorf("cli.AgentVariables names --%s, which meshid agent lacks", flag)
		}
	}
	for _, row := range rows {
		names := rowFlags[row.line]
		if len(names) == 0 {
			continue // a group's title, or a row already reported
		}
		var want []string
		for _, name := range names {
			if v, ok := variables[name]; ok {
				want = append(want, v)
			}
		}
		cell, flagList := row.cells["variable"], "--"+strings.Join(names, ", --")
		got := codeSpans(cell)
		slices.Sort(want)
		slices.Sort(got)
		switch {
		case len(want) == 0 && cell != "—":
			t.Errorf("%s:%d: no variable sets %s: want — in the variable column, not %q", readmePath, row.line, flagList, cell)
		case len(want) > 0 && !slices.Equal(got, want):
			t.Errorf("%s:%d: the variables of %s are %s, not %q", readmePath, row.line, flagList, strings.Join(want, ", "), cell)
		}
	}

	// meshid-agent builds its agent command so: no embedded CA, no bootstrap check.
	slim := cli.NewAgentCommand(&cli.Globals{}, cli.RunAgent, func(string) (string, bool) { return "", false }, nil, nil, nil)
	slimFlags := map[string]bool{}
	slim.Flags().VisitAll(func(f *pflag.Flag) { slimFlags[f.Name] = true })
	for name := range flags {
		if !slimFlags[name] {
			t.Errorf("meshid-agent agent lacks --%s: say so in README's table, and here", name)
		}
	}
	for name := range slimFlags {
		if _, ok := flags[name]; !ok && name != "help" {
			t.Errorf("meshid-agent agent has --%s, which meshid agent lacks", name)
		}
	}
}

// README's flag table of `meshid ca` has a row for every flag, with the default --help shows
// and, next to the flag, the variable that sets it (caFields).
func TestREADMECATable(t *testing.T) {
	t.Parallel()
	header := []string{"flag", "default", "meaning"}
	rows := readmeTable(t, readme(t), "## `meshid ca`", header)
	rowFlags := checkFlagTable(t, "meshid ca", rows, header, "flag", commandFlags(subcommand(t, rootForREADME(), "ca")))
	variables := caFields().Env
	for _, row := range rows {
		var want, got []string
		for _, name := range rowFlags[row.line] {
			if v, ok := variables[name]; ok {
				want = append(want, v)
			}
		}
		for _, span := range codeSpans(row.cells["flag"]) {
			if !strings.HasPrefix(span, "--") {
				got = append(got, span)
			}
		}
		slices.Sort(want)
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("%s:%d: the variables of --%s are [%s], not [%s]", readmePath, row.line,
				strings.Join(rowFlags[row.line], ", --"), strings.Join(want, ", "), strings.Join(got, ", "))
		}
	}
}

// The flags every command has are named in README's prose, with their defaults.
func TestREADMEGlobalFlags(t *testing.T) {
	t.Parallel()
	text := readme(t)
	rootForREADME().PersistentFlags().VisitAll(func(f *pflag.Flag) {
		if want := fmt.Sprintf("`--%s` (`%s`", f.Name, f.DefValue); !strings.Contains(text, want) {
			t.Errorf("%s does not say %s)", readmePath, want)
		}
	})
}
