// Command mtpdraft-hotpath measures the hot path as a Go verifier sees it: N concurrent
// verifiers, each with one state and one ProposeStream, each step a Propose (a batch of one)
// that carries the verdict on the step before (0 accepted, so every step drafts from the same
// context length). With -states S, each verifier steps S states together instead: one batch of
// S a step, its verdicts fused.
//
//	mtpdraft-hotpath -address 127.0.0.1:50051 [-streams 1] [-states 0] [-prompt 2048]
//	                 [-num-drafts 4] [-warmup 50] [-steps 300] [-seed 0]
//
// Hiddens are random bfloat16 rows of the server's hidden size. It prints one JSON object: the
// latency percentiles of the measured steps (microseconds) and drafts per second over the window
// from the first measured step to the last answer, every verifier having warmed up first.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/mtpdraft/mtpdraft/client/go/drafter"
)

type verifier struct {
	states  []uint64
	token   int32
	hidden  drafter.Tensor // [1, hidden], or [S, hidden] with -states S
	stream  *drafter.Stream
	batched bool // -states S: each step one batch of S states, else a Propose
}

// step sends the verifier's step at `step` (its verdicts on the step before, 0 accepted) and
// returns the drafts it got.
func (v *verifier) step(ctx context.Context, step int, prompt int64, numDrafts int32) (int, error) {
	position := prompt + int64(step) // 0 accepted: the bonus token's row is the next position
	if !v.batched {
		args := drafter.ProposeArgs{Token: v.token, Hidden: v.hidden, Position: position, NumDrafts: numDrafts}
		if step > 0 {
			args.Previous = &drafter.Verdict{NumAccepted: 0}
		}
		p, err := v.stream.Propose(ctx, v.states[0], args)
		if err != nil {
			return 0, err
		}
		return len(p.Tokens), nil
	}
	n := len(v.states)
	batch := drafter.Batch{StateIDs: v.states, Tokens: make([]int32, n), Positions: make([]int64, n),
		Hiddens: v.hidden, NumDrafts: []int32{numDrafts}}
	for i := range batch.Tokens {
		batch.Tokens[i], batch.Positions[i] = v.token, position
	}
	if step > 0 {
		batch.NumAccepted = make([]int32, n)
	}
	r, err := v.stream.Step(ctx, batch)
	if err != nil {
		return 0, err
	}
	if len(r.Errors) > 0 {
		for _, e := range r.Errors {
			return 0, e
		}
	}
	drafts := 0
	for _, c := range r.Counts {
		drafts += int(c)
	}
	return drafts, nil
}

type report struct {
	Streams     int     `json:"streams"`
	States      int     `json:"states"`
	Steps       int     `json:"steps"`
	P50us       float64 `json:"p50_us"`
	P90us       float64 `json:"p90_us"`
	P99us       float64 `json:"p99_us"`
	MaxUs       float64 `json:"max_us"`
	Drafts      int     `json:"drafts"`
	DraftsPerS  float64 `json:"drafts_per_s"`
	WindowS     float64 `json:"window_s"`
	HiddenSize  int64   `json:"hidden_size"`
	NumDrafts   int32   `json:"num_drafts"`
	PromptRows  int64   `json:"prompt_rows"`
	ClientLabel string  `json:"client"`
}

func randomRows(rng *rand.Rand, rows, width int64) drafter.Tensor {
	values := make([]float32, rows*width)
	for i := range values {
		values[i] = float32(rng.NormFloat64())
	}
	return drafter.BF16(values, rows, width)
}

func percentile(sorted []time.Duration, q float64) float64 {
	i := int(q * float64(len(sorted)-1))
	return float64(sorted[i].Nanoseconds()) / 1e3
}

func run() error {
	address := flag.String("address", "", "server host:port")
	streams := flag.Int("streams", 1, "concurrent verifiers, one state and one stream each")
	states := flag.Int("states", 0, "states per verifier, stepped as one batch a message (0: one state, a Propose a message)")
	prompt := flag.Int64("prompt", 2048, "the prompt's length: rows 1..prompt-1 are prefilled")
	numDrafts := flag.Int("num-drafts", 4, "drafts per step (K)")
	warmup := flag.Int("warmup", 50, "steps per verifier before the measured ones")
	steps := flag.Int("steps", 300, "measured steps per verifier")
	seed := flag.Int64("seed", 0, "seed of the random tokens and hiddens")
	flag.Parse()
	if *address == "" {
		return fmt.Errorf("usage: mtpdraft-hotpath -address HOST:PORT [flags]")
	}
	client, err := drafter.Dial(*address)
	if err != nil {
		return err
	}
	defer client.Close()
	ctx := context.Background()
	info, err := client.GetInfo(ctx)
	if err != nil {
		return err
	}
	width, vocab := int64(info.HiddenSize), int32(info.VocabSize)
	rng := rand.New(rand.NewSource(*seed))
	tokens := make([]int32, *prompt-1)
	for i := range tokens {
		tokens[i] = rng.Int31n(vocab)
	}
	prefix := randomRows(rng, *prompt-1, width)

	verifiers := make([]*verifier, *streams)
	defer func() {
		for _, v := range verifiers {
			if v == nil {
				continue
			}
			if v.stream != nil {
				v.stream.Close()
			}
			for _, state := range v.states {
				client.FreeState(ctx, state)
			}
		}
	}()
	rows := *states
	if rows < 1 {
		rows = 1
	}
	for i := range verifiers {
		v := &verifier{token: rng.Int31n(vocab), hidden: randomRows(rng, int64(rows), width), batched: *states > 0}
		verifiers[i] = v
		for j := 0; j < rows; j++ {
			state, err := client.AllocState(ctx)
			if err != nil {
				return err
			}
			v.states = append(v.states, state)
			if _, err := client.Prefill(ctx, state, 1, tokens, prefix, 0); err != nil {
				return err
			}
		}
		if v.stream, err = client.OpenStream(ctx); err != nil {
			return err
		}
	}

	// Each verifier runs its steps in a closed loop; the measured ones start together.
	var mu sync.Mutex
	var times []time.Duration
	drafts := 0
	loop := func(v *verifier, first, count int, record bool) error {
		for step := first; step < first+count; step++ {
			started := time.Now()
			n, err := v.step(ctx, step, *prompt, int32(*numDrafts))
			if err != nil {
				return err
			}
			if record {
				elapsed := time.Since(started)
				mu.Lock()
				times = append(times, elapsed)
				drafts += n
				mu.Unlock()
			}
		}
		return nil
	}
	together := func(first, count int, record bool) error {
		errs := make(chan error, len(verifiers))
		for _, v := range verifiers {
			go func(v *verifier) { errs <- loop(v, first, count, record) }(v)
		}
		var firstErr error
		for range verifiers {
			if err := <-errs; err != nil && firstErr == nil {
				firstErr = err
			}
		}
		return firstErr
	}
	if err := together(0, *warmup, false); err != nil {
		return err
	}
	started := time.Now()
	if err := together(*warmup, *steps, true); err != nil {
		return err
	}
	window := time.Since(started).Seconds()

	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	out := report{
		Streams: *streams, States: rows, Steps: len(times),
		P50us: percentile(times, 0.5), P90us: percentile(times, 0.9), P99us: percentile(times, 0.99),
		MaxUs: percentile(times, 1), Drafts: drafts, DraftsPerS: float64(drafts) / window,
		WindowS: window, HiddenSize: width, NumDrafts: int32(*numDrafts), PromptRows: *prompt,
		ClientLabel: "go",
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "mtpdraft-hotpath:", err)
		os.Exit(1)
	}
}
