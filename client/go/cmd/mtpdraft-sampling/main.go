// Command mtpdraft-sampling checks drafter.Accept against the sampling vector
// (tests/conformance/sampling_vector.json), no server needed:
//
//	mtpdraft-sampling [-vector PATH]
//
// It prints one line per case, then "go: N passed, M failed", and exits 1 on any failure, 2 on
// a vector it may not check: a wrong format, no cases, a case without drafts, q_ids, q_probs,
// target_probs, uniforms or expect.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"reflect"

	"github.com/mtpdraft/mtpdraft/client/go/drafter"
)

const vectorFormat = "mtpdraft-sampling/1"

type expectation struct {
	NumAccepted []int32 `json:"num_accepted"`
	NextTokens  []int32 `json:"next_tokens"`
}

type samplingCase struct {
	Name        string        `json:"name"`
	Drafts      [][]int32     `json:"drafts"`
	QIDs        [][][]int32   `json:"q_ids"`
	QProbs      [][][]float64 `json:"q_probs"`
	TargetProbs [][][]float64 `json:"target_probs"`
	Counts      []int32       `json:"counts"` // absent: every row K
	Uniforms    [][]float64   `json:"uniforms"`
	Expect      *expectation  `json:"expect"`
}

type vector struct {
	Format *string        `json:"format"`
	Cases  []samplingCase `json:"cases"`
}

// check says why no runner may check the vector, or nil if one may.
func (v *vector) check() error {
	if v.Format == nil || *v.Format != vectorFormat {
		return fmt.Errorf("format is not %q", vectorFormat)
	}
	if len(v.Cases) == 0 {
		return errors.New("cases is missing or empty")
	}
	for i, c := range v.Cases {
		for _, f := range []struct {
			name string
			size int
		}{{"drafts", len(c.Drafts)}, {"q_ids", len(c.QIDs)}, {"q_probs", len(c.QProbs)},
			{"target_probs", len(c.TargetProbs)}, {"uniforms", len(c.Uniforms)}} {
			if f.size == 0 {
				return fmt.Errorf("case %d (%s): %s is missing or empty", i, c.Name, f.name)
			}
		}
		if c.Expect == nil || len(c.Expect.NumAccepted) != len(c.Drafts) ||
			len(c.Expect.NextTokens) != len(c.Drafts) {
			return fmt.Errorf("case %d (%s): expect is missing or not one value a row", i, c.Name)
		}
	}
	return nil
}

func main() {
	path := flag.String("vector", "tests/conformance/sampling_vector.json", "the sampling vector")
	flag.Parse()
	raw, err := os.ReadFile(*path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "go:", err)
		os.Exit(2)
	}
	var v vector
	err = json.Unmarshal(raw, &v)
	if err == nil {
		err = v.check()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "go: bad vector:", err)
		os.Exit(2)
	}
	passed, failed := 0, 0
	for _, c := range v.Cases {
		got, err := drafter.Accept(c.Drafts, c.QIDs, c.QProbs, c.TargetProbs, c.Counts, c.Uniforms)
		want := drafter.Accepted{NumAccepted: c.Expect.NumAccepted, NextTokens: c.Expect.NextTokens}
		switch {
		case err != nil:
			failed++
			fmt.Printf("FAIL %s: %v\n", c.Name, err)
		case !reflect.DeepEqual(got, want):
			failed++
			fmt.Printf("FAIL %s: kept %v, next %v; expected kept %v, next %v\n", c.Name,
				got.NumAccepted, got.NextTokens, want.NumAccepted, want.NextTokens)
		default:
			passed++
			fmt.Printf("ok   %s: kept %v, next %v\n", c.Name, got.NumAccepted, got.NextTokens)
		}
	}
	fmt.Printf("go: %d passed, %d failed\n", passed, failed)
	if failed > 0 {
		os.Exit(1)
	}
}
