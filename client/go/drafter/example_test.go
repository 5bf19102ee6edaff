package drafter_test

import (
	"context"
	"fmt"
	"log"

	"google.golang.org/grpc/status"

	"github.com/mtpdraft/mtpdraft/client/go/drafter"
	"github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
)

// A verifier's decode step for B states in one call. Each state's row carries its last token
// (the bonus token the target sampled), that token's position, the target hidden before it (one
// row of hiddens), and the verdict on the state's pending proposal; the answer holds every
// state's next drafts.
func ExampleClient_ProposeBatch() {
	ctx := context.Background()
	c, err := drafter.Dial("localhost:50051")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	const hidden = 384
	states := []uint64{11, 12}     // allocated and prefilled earlier
	accepted := []int32{2, 0}      // how many of each state's last drafts the target accepted
	tokens := []int32{17, 42}      // the tokens the target sampled after them
	positions := []int64{130, 96}  // those tokens' positions
	h := make([]float32, 2*hidden) // the target's last-layer hiddens at positions - 1
	r, err := c.ProposeBatch(ctx, drafter.Batch{
		StateIDs:    states,
		Tokens:      tokens,
		Positions:   positions,
		Hiddens:     drafter.BF16(h, 2, hidden),
		NumDrafts:   []int32{4}, // K = 4 for every state
		NumAccepted: accepted,
	})
	if err != nil {
		log.Fatal(err) // the columns do not fit together: nothing changed
	}
	for i, state := range states {
		if err := r.Errors[i]; err != nil {
			reason, field := drafter.ErrorDetails(err)
			fmt.Println(state, status.Code(err), reason, field) // this state is unchanged
			continue
		}
		drafts, probs := r.Row(i)
		fmt.Println(state, r.FirstPositions[i], drafts, probs, r.Confidences[i])
	}
}

// A sampling verifier's steps over B states (README.md, "Sampled drafts"): each state draws its
// drafts from q, and each step's answer goes straight into AcceptBatch, whose verdicts and
// tokens are the next step's.
func ExampleAcceptBatch() {
	ctx := context.Background()
	c, err := drafter.Dial("localhost:50051")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	sampling := &mtpdraftv1.SamplingParams{Temperature: 0.8, TopK: 50, Seed: 7}
	state, err := c.AllocStateWith(ctx, drafter.StateOptions{Sampling: sampling})
	if err != nil {
		log.Fatal(err)
	}
	// ... prefill it; one state here, any number in a real step
	batch := drafter.Batch{
		StateIDs: []uint64{state}, Tokens: []int32{17}, Positions: []int64{9},
		Hiddens: drafter.FP32(targetHiddens(1), 1, 384), NumDrafts: []int32{4},
	}
	for step := 0; step < 3; step++ {
		r, err := c.ProposeBatch(ctx, batch) // drafts drawn from q; q in r.QIDs, r.QProbs
		if err != nil {
			log.Fatal(err)
		}
		v, err := drafter.AcceptBatch(r, targetProbs(r), nil) // uniforms: rand.Float64
		if err != nil {
			log.Fatal(err)
		}
		for i := range batch.Positions {
			batch.Positions[i] = r.FirstPositions[i] + int64(v.NumAccepted[i])
		}
		batch.NumAccepted, batch.Tokens = v.NumAccepted, v.NextTokens
		batch.Hiddens = drafter.FP32(targetHiddens(1), 1, 384)
	}
}

// targetProbs stands for a verifier's target: its distribution at each draft's position and
// at the one after, [B][Width+1][V] (here uniform over 256 tokens).
func targetProbs(r *drafter.BatchResult) [][][]float64 {
	p := make([][][]float64, r.Len())
	for i := range p {
		for j := 0; j <= r.Width; j++ {
			row := make([]float64, 256)
			for t := range row {
				row[t] = 1.0 / 256
			}
			p[i] = append(p[i], row)
		}
	}
	return p
}

// targetHiddens stands for the target's last-layer hiddens of n tokens (384 values each).
func targetHiddens(n int) []float32 { return make([]float32, n*384) }
