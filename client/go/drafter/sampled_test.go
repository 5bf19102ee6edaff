package drafter

import (
	"reflect"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
)

// Sampling changes and the drafter's own K, given state by state, become the batch's columns:
// the rows that change sampling (ascending) with their parameters, and draft caps and verify
// costs for every row once any is set.
func TestBatchOfSamplingAndChosenK(t *testing.T) {
	hot := &pb.SamplingParams{Temperature: 0.8, TopK: 4, Seed: 7}
	cold := &pb.SamplingParams{}
	b, err := BatchOf([]BatchRequest{
		{3, ProposeArgs{Hidden: FP32([]float32{1}), NumDrafts: 2, Sampling: hot}},
		{4, ProposeArgs{Hidden: FP32([]float32{2}), NumDrafts: 0, DraftCap: 5, VerifyTokenCost: 0.25}},
		{5, ProposeArgs{Hidden: FP32([]float32{3}), NumDrafts: 1, Sampling: cold}},
	})
	if err != nil {
		t.Fatal(err)
	}
	req := batchRequest(b)
	if !reflect.DeepEqual(req.SamplingRows, []int32{0, 2}) || len(req.Sampling) != 2 ||
		!proto.Equal(req.Sampling[0], hot) || !proto.Equal(req.Sampling[1], cold) {
		t.Fatalf("sampling columns %v %v", req.SamplingRows, req.Sampling)
	}
	if !reflect.DeepEqual(req.DraftCaps, []int32{0, 5, 0}) ||
		!reflect.DeepEqual(req.VerifyTokenCosts, []float32{0, 0.25, 0}) {
		t.Fatalf("chosen-K columns %v %v", req.DraftCaps, req.VerifyTokenCosts)
	}
	plain, err := BatchOf([]BatchRequest{{3, ProposeArgs{Hidden: FP32([]float32{1}), NumDrafts: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	if r := batchRequest(plain); r.SamplingRows != nil || r.Sampling != nil || r.DraftCaps != nil ||
		r.VerifyTokenCosts != nil {
		t.Fatalf("columns sent without sampling or a chosen K: %v", r)
	}
	p := proposeRequest(3, ProposeArgs{NumDrafts: 0, Sampling: hot, DraftCap: 6, VerifyTokenCost: 0.5})
	if !proto.Equal(p.Sampling, hot) || p.DraftCap != 6 || p.VerifyTokenCost != 0.5 || p.NumDrafts != 0 {
		t.Fatalf("propose request %v", p)
	}
}

// The worked example of sampling_test.go as an answer's columns: row 0 sampled (two drafts),
// row 1 one draft; q is [B, Width, support] with zeros past a row's count.
func sampledAnswer() *pb.ProposeBatchResponse {
	return &pb.ProposeBatchResponse{
		Width:          2,
		Drafts:         []int32{1, 2, 0, -1},
		Probs:          []float32{0.5, 1, 0.6, 0},
		DraftCounts:    []int32{2, 1},
		Confidences:    []float32{0.5, 0.6},
		FirstPositions: []int64{4, 9},
		QSupport:       2,
		QIds:           []int32{1, 0, 2, 0, 0, 1, 0, 0},
		QProbs:         []float32{0.5, 0.5, 1, 0, 0.6, 0.4, 0, 0},
	}
}

func TestBatchResultCarriesQ(t *testing.T) {
	r, err := batchResult(sampledAnswer(), []uint64{7, 8})
	if err != nil {
		t.Fatal(err)
	}
	p, err := r.Proposal(1)
	if err != nil || p.QSupport != 2 || !reflect.DeepEqual(p.QIds, []int32{0, 1}) ||
		!reflect.DeepEqual(p.QProbs, []float32{0.6, 0.4}) {
		t.Fatalf("row 1's q: %v %v", p, err)
	}
	drafts, qIDs, qProbs := r.DraftsWithQ()
	if !reflect.DeepEqual(drafts, [][]int32{{1, 2}, {0, -1}}) ||
		!reflect.DeepEqual(qIDs, [][][]int32{{{1, 0}, {2, 0}}, {{0, 1}, {0, 0}}}) ||
		qProbs[1][0][0] != float64(float32(0.6)) || qProbs[0][1][0] != 1 {
		t.Fatalf("drafts %v, q %v %v", drafts, qIDs, qProbs)
	}
	bad := sampledAnswer()
	bad.QProbs = bad.QProbs[:7]
	if _, err := batchResult(bad, []uint64{7, 8}); err == nil {
		t.Fatal("a short q_probs column is accepted")
	}
}

// An answer goes into AcceptBatch as it is: the verdicts of the worked example.
func TestAcceptBatchTakesTheAnswer(t *testing.T) {
	r, err := batchResult(sampledAnswer(), []uint64{7, 8})
	if err != nil {
		t.Fatal(err)
	}
	in := handExample()
	got, err := AcceptBatch(r, in.target, in.uniforms)
	want := Accepted{NumAccepted: []int32{1, 1}, NextTokens: []int32{1, 0}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v %v, want %+v", got, err, want)
	}
	// Greedy answers carry no q: each draft is its own q at 1, kept exactly when u < p(draft).
	greedy := sampledAnswer()
	greedy.QSupport, greedy.QIds, greedy.QProbs = 0, nil, nil
	r, err = batchResult(greedy, []uint64{7, 8})
	if err != nil {
		t.Fatal(err)
	}
	// Row 0: draft 1 (p 0.2) kept at u = 0.1, draft 2 (p 0.6) refused at u = 0.7; the next
	// token from (0.3, 0.1, 0) / 0.4 at u = 0.8: token 1. Row 1: draft 0 (p 0.7) refused at
	// u = 0.9; the next token from (0, 0.2, 0.1) / 0.3 at u = 0.5: token 1.
	got, err = AcceptBatch(r, in.target, [][]float64{{0.1, 0.7, 0.8}, {0.9, 0, 0.5}})
	want = Accepted{NumAccepted: []int32{1, 0}, NextTokens: []int32{1, 1}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("greedy: got %+v %v, want %+v", got, err, want)
	}
	if _, err := AcceptBatch(r, in.target[:1], nil); err == nil {
		t.Fatal("a target of one row for two is accepted")
	}
}
