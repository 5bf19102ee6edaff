package drafter

import (
	"math"
	"reflect"
	"strings"
	"testing"
)

type acceptInputs struct {
	drafts   [][]int32
	qIDs     [][][]int32
	qProbs   [][][]float64
	target   [][][]float64
	counts   []int32
	uniforms [][]float64
}

func (in acceptInputs) accept() (Accepted, error) {
	return Accept(in.drafts, in.qIDs, in.qProbs, in.target, in.counts, in.uniforms)
}

// The worked example of the Python client's tests. Two rows, K = 2, V = 3. Row 0: draft 1
// has p 0.2, q 0.5: kept at u = 0.3 (< 0.4); draft 2 has p 0.6, q 1: refused at u = 0.7; the
// next token comes from max(p - q, 0) = (0.3, 0.1, 0) / 0.4 at u = 0.8: token 1. Row 1 has
// one draft (count 1), kept (p >= q); the bonus token comes from (0.1, 0.1, 0.8) at u = 0.05:
// token 0.
func handExample() acceptInputs {
	return acceptInputs{
		drafts: [][]int32{{1, 2}, {0, 0}},
		qIDs:   [][][]int32{{{1, 0}, {2, 0}}, {{0, 1}, {0, 1}}},
		qProbs: [][][]float64{{{0.5, 0.5}, {1, 0}}, {{0.6, 0.4}, {1, 0}}},
		target: [][][]float64{
			{{0.5, 0.2, 0.3}, {0.3, 0.1, 0.6}, {1, 0, 0}},
			{{0.7, 0.2, 0.1}, {0.1, 0.1, 0.8}, {1, 0, 0}},
		},
		counts:   []int32{2, 1},
		uniforms: [][]float64{{0.3, 0.7, 0.8}, {0.9, 0, 0.05}},
	}
}

func TestAcceptByHand(t *testing.T) {
	got, err := handExample().accept()
	if err != nil {
		t.Fatal(err)
	}
	want := Accepted{NumAccepted: []int32{1, 1}, NextTokens: []int32{1, 0}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
}

// q one-hot: a draft is kept exactly when u < p(draft); counts nil is K for every row.
func TestAcceptGreedy(t *testing.T) {
	p := [][][]float64{{{0.1, 0.6, 0.3}, {0.2, 0.2, 0.6}}}
	for _, c := range []struct {
		u    float64
		kept int32
	}{{0.59, 1}, {0.61, 0}} {
		got, err := Accept([][]int32{{1}}, [][][]int32{{{1}}}, [][][]float64{{{1}}}, p, nil,
			[][]float64{{c.u, 0.5}})
		if err != nil {
			t.Fatal(err)
		}
		if got.NumAccepted[0] != c.kept {
			t.Errorf("u = %v: kept %d, want %d", c.u, got.NumAccepted[0], c.kept)
		}
	}
}

// A draft q gives no mass, where p gives none either: refused even at u = 0; p = q leaves
// max(p - q, 0) empty, so the next token comes from p: at u = 0.5, token 2 of (0, 0.5, 0.5).
func TestAcceptNoResidualMass(t *testing.T) {
	p := [][][]float64{{{0, 0.5, 0.5}, {1, 0, 0}}}
	got, err := Accept([][]int32{{0}}, [][][]int32{{{1, 2}}}, [][][]float64{{{0.5, 0.5}}}, p, nil,
		[][]float64{{0, 0.5}})
	if err != nil {
		t.Fatal(err)
	}
	if got.NumAccepted[0] != 0 || got.NextTokens[0] != 2 {
		t.Fatalf("got %+v, want 0 kept, token 2", got)
	}
}

func TestAcceptRefusesBadInputs(t *testing.T) {
	for _, c := range []struct {
		name    string
		breakIt func(in *acceptInputs)
		says    string
	}{
		{"rows", func(in *acceptInputs) { in.uniforms = in.uniforms[:1] }, "uniforms has 1 rows"},
		{"counts", func(in *acceptInputs) { in.counts[1] = 3 }, "counts[1] = 3"},
		{"support", func(in *acceptInputs) { in.qProbs[0][1] = in.qProbs[0][1][:1] },
			"qIDs[0][1] has 2 ids, qProbs[0][1] 1"},
		{"vocabulary", func(in *acceptInputs) { in.target[1][2] = in.target[1][2][:2] },
			"targetProbs[1][2] has 2 probabilities, want V = 3"},
		{"positions", func(in *acceptInputs) { in.target[0] = in.target[0][:2] },
			"targetProbs[0] has 2 distributions, want K + 1 = 3"},
		{"draft", func(in *acceptInputs) { in.drafts[0][1] = 3 }, "drafts[0][1] = 3"},
		{"id", func(in *acceptInputs) { in.qIDs[1][0][1] = -1 }, "qIDs[1][0][1] = -1"},
		{"probability", func(in *acceptInputs) { in.target[0][1][0] = math.NaN() }, "targetProbs[0][1][0] = NaN"},
		{"uniform", func(in *acceptInputs) { in.uniforms[1][2] = 1 }, "uniforms[1][2] = 1"},
		{"no mass", func(in *acceptInputs) { in.target[1][1] = []float64{0, 0, 0} }, "targetProbs[1][1] has no mass"},
	} {
		in := handExample()
		c.breakIt(&in)
		got, err := in.accept()
		if err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: got %+v, error %v; want an error saying %q", c.name, got, err, c.says)
		}
	}
}

// Drafts past a row's count are never read: any value will do.
func TestAcceptIgnoresDraftsPastCount(t *testing.T) {
	in := handExample()
	in.drafts[1][1], in.qIDs[1][1][0] = -5, 99
	got, err := in.accept()
	if err != nil || got.NextTokens[1] != 0 {
		t.Fatalf("got %+v, %v", got, err)
	}
}
