// Command drafter-example is a verifier's decode loop in a module of its own, using the
// mtpdraft Go client (module github.com/mtpdraft/mtpdraft/client/go, the folder client/go)
// through a replace directive:
//
//	go run . -address 127.0.0.1:50051
//
// It prefills a state with a 4-token prompt, then runs 3 verify steps on one stream, each
// deciding the verdict with drafter.Accept: the drafts are greedy (q one-hot), the target's
// distributions made up, as are the hiddens: a real verifier passes its target's.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"math/rand"
	"time"

	"github.com/mtpdraft/mtpdraft/client/go/drafter"
)

func main() {
	address := flag.String("address", "localhost:50051", "the server's host:port")
	flag.Parse()
	c, err := drafter.Dial(*address)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// Unary calls: each bounded by its own context.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	info, err := c.GetInfo(ctx)
	if err != nil {
		log.Fatal(err)
	}
	hiddenSize, vocab := int64(info.HiddenSize), int(info.VocabSize)
	rng := rand.New(rand.NewSource(1))
	// A made-up target distribution giving `token` about half its mass.
	targetProbs := func(token int32) []float64 {
		p, total := make([]float64, vocab), 0.0
		for i := range p {
			p[i] = rng.Float64()
			total += p[i]
		}
		p[token] += total
		for i := range p {
			p[i] /= 2 * total
		}
		return p
	}
	hiddens := func(rows int64) drafter.Tensor {
		values := make([]float32, rows*hiddenSize)
		for i := range values {
			values[i] = float32(rng.NormFloat64())
		}
		return drafter.FP32(values, rows, hiddenSize)
	}
	state, err := c.AllocState(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer c.FreeState(context.Background(), state)
	// Rows (x1, h0) .. (x3, h2) from position 1; x4 is the last prompt token.
	if _, err := c.Prefill(ctx, state, 1, []int32{11, 12, 13}, hiddens(3), 0); err != nil {
		log.Fatal(err)
	}

	// The stream has no deadline (context.Background()): it lives as long as the verifier.
	s, err := c.OpenStream(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	args := drafter.ProposeArgs{Token: 14, Hidden: hiddens(1), Position: 4, NumDrafts: 3}
	for step := 0; step < 3; step++ {
		p, err := s.Propose(ctx, state, args)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("step %d: drafts %v from position %d\n", step, p.Tokens, p.FirstPosition)
		// The target's distributions at each draft's position and after the last; greedy drafts
		// have q one-hot.
		k := len(p.Tokens)
		qIDs, qProbs := make([][]int32, k), make([][]float64, k)
		target, uniforms := make([][]float64, k+1), make([]float64, k+1)
		for j, token := range append(append([]int32{}, p.Tokens...), 0) {
			if j < k {
				qIDs[j], qProbs[j] = []int32{token}, []float64{1}
			}
			target[j], uniforms[j] = targetProbs(token), rng.Float64()
		}
		verdict, err := drafter.Accept([][]int32{p.Tokens}, [][][]int32{qIDs}, [][][]float64{qProbs},
			[][][]float64{target}, nil, [][]float64{uniforms})
		if err != nil {
			log.Fatal(err)
		}
		accepted := verdict.NumAccepted[0]
		fmt.Printf("step %d: kept %d, next token %d\n", step, accepted, verdict.NextTokens[0])
		args = drafter.ProposeArgs{Token: verdict.NextTokens[0], Hidden: hiddens(1),
			Position: args.Position + int64(accepted) + 1, NumDrafts: 3,
			Previous: &drafter.Verdict{NumAccepted: accepted}}
	}
	fmt.Println("go example: ok")
}
