package drafter_test

import (
	"context"
	"fmt"
	"log"

	"google.golang.org/grpc/status"

	"github.com/mtpdraft/mtpdraft/client/go/drafter"
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
