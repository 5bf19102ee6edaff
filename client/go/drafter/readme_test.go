package drafter_test

import (
	"os"
	"strings"
	"testing"
)

// README.md's "Sampled drafts" example is part of ExampleAcceptBatch, which the tests compile.
func TestReadmeSampledExampleIsCompiled(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	section := string(readme)[strings.Index(string(readme), "\n## Sampled drafts\n")+1:]
	start := strings.Index(section, "```go\n")
	if start < 0 {
		t.Fatal(`README.md has no go block under "## Sampled drafts"`)
	}
	block := section[start+len("```go\n"):]
	block = block[:strings.Index(block, "```")]
	source, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	body := string(source)[strings.Index(string(source), "func ExampleAcceptBatch() {"):]
	body = strings.ReplaceAll(body[:strings.Index(body, "\n}\n")+1], "\n\t", "\n")
	if !strings.Contains(body, block) {
		t.Fatalf("README.md's sampled example is not in ExampleAcceptBatch:\n%s", block)
	}
}
