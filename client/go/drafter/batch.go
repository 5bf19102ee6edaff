package drafter

import (
	"context"
	"fmt"

	pb "github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
)

// Batch is a verifier's whole step for B states, as columns: row i of every column belongs to
// StateIDs[i]. Optional columns are left empty (nil); NumDrafts and MinConfidence may also hold
// one value for every state. BatchOf makes one from states given one by one.
type Batch struct {
	StateIDs  []uint64
	Tokens    []int32 // each state's last token (sampled or prefilled last)
	Positions []int64 // each last token's position
	Hiddens   Tensor  // [B, hidden]: the target hidden of each last token, at its position - 1
	NumDrafts []int32 // K per state, or one K for all

	// NumAccepted is the verdict on each state's pending proposal, applied first (-1 where a
	// state has none); empty: no verdicts.
	NumAccepted []int32
	// RefeedRows is each state's number of RefeedHiddens rows: 0, or its NumAccepted. The rows
	// of state i follow those of state i - 1 in RefeedHiddens ([sum(RefeedRows), hidden]).
	RefeedRows    []int32
	RefeedHiddens *Tensor
	// BitmaskRows is each state's number of Bitmasks rows: 0 (no mask), or 1 .. K masking its
	// drafts as ProposeArgs.Bitmask does. Bitmasks is [sum(BitmaskRows), words], int32.
	BitmaskRows []int32
	Bitmasks    *Tensor
	// MinConfidence stops a state's drafting as ProposeArgs.MinConfidence does: B values, one
	// for every state, or empty (draft all K).
	MinConfidence []float32
	// StepNumbers numbers each state's step as ProposeArgs.StepNumber does: B values, one for
	// every state (a verifier's own step count), or empty (not numbered).
	StepNumbers []uint64
	// SamplingRows are the rows (ascending, each once) whose states take new sampling from
	// this step on, and Sampling their parameters, one per row listed; empty: no change.
	SamplingRows []int32
	Sampling     []*pb.SamplingParams
	// GrammarRows are the rows (ascending, each once) whose states take a grammar (or
	// NoGrammar) from this step on, and Grammars those grammars, one per row listed; a grammar
	// the server refuses fails its row alone. Empty: no change.
	GrammarRows []int32
	Grammars    []*pb.Grammar
	// DraftCaps and VerifyTokenCosts are, for rows with NumDrafts 0 (the drafter chooses K),
	// ProposeArgs' DraftCap and VerifyTokenCost: B values, one for every state, or empty (0).
	DraftCaps        []int32
	VerifyTokenCosts []float32
	// ReturnBitmasks asks for each grammar state's bitmasks (BatchResult.Bitmasks).
	ReturnBitmasks bool
}

// BatchRequest is one state of a batch given state by state: the state and its Propose inputs.
type BatchRequest struct {
	State uint64
	ProposeArgs
}

// BatchOf is the Batch of states given one by one: row i is requests[i]'s. Their hiddens (each
// [hidden] or [1, hidden]) are stacked, their refeeds and bitmasks put one after another with
// each one's row count; bitmasks of fewer words are padded with zero words (which allow no
// token, as the server reads them). The hiddens, and the refeeds, must share one dtype and width.
func BatchOf(requests []BatchRequest) (Batch, error) {
	var b Batch
	var hiddens, refeeds, masks rows
	verdicts, floors, numbered, chosen := false, false, false, false
	for i, r := range requests {
		if r.Sampling != nil {
			b.SamplingRows = append(b.SamplingRows, int32(i))
			b.Sampling = append(b.Sampling, r.Sampling)
		}
		if r.Grammar != nil {
			b.GrammarRows = append(b.GrammarRows, int32(i))
			b.Grammars = append(b.Grammars, r.Grammar)
		}
		b.DraftCaps = append(b.DraftCaps, r.DraftCap)
		b.VerifyTokenCosts = append(b.VerifyTokenCosts, r.VerifyTokenCost)
		chosen = chosen || r.DraftCap != 0 || r.VerifyTokenCost != 0
		b.StateIDs = append(b.StateIDs, r.State)
		b.Tokens = append(b.Tokens, r.Token)
		b.Positions = append(b.Positions, r.Position)
		b.NumDrafts = append(b.NumDrafts, r.NumDrafts)
		b.MinConfidence = append(b.MinConfidence, r.MinConfidence)
		floors = floors || r.MinConfidence != 0
		b.StepNumbers = append(b.StepNumbers, r.StepNumber)
		numbered = numbered || r.StepNumber != 0
		n, err := hiddens.add(&r.Hidden, false)
		if err == nil && n != 1 {
			err = fmt.Errorf("%d rows, where one is expected", n)
		}
		if err != nil {
			return Batch{}, fmt.Errorf("drafter: requests[%d].Hidden: %v", i, err)
		}
		accepted, refeed := int32(-1), int32(0)
		if v := r.Previous; v != nil {
			accepted, verdicts = v.NumAccepted, true
			n, err := refeeds.add(v.RefeedHiddens, false)
			if err != nil {
				return Batch{}, fmt.Errorf("drafter: requests[%d].Previous.RefeedHiddens: %v", i, err)
			}
			refeed = int32(n)
		}
		b.NumAccepted = append(b.NumAccepted, accepted)
		b.RefeedRows = append(b.RefeedRows, refeed)
		n, err = masks.add(r.Bitmask, true)
		if err != nil {
			return Batch{}, fmt.Errorf("drafter: requests[%d].Bitmask: %v", i, err)
		}
		b.BitmaskRows = append(b.BitmaskRows, int32(n))
	}
	b.Hiddens = hiddens.tensor()
	if !verdicts {
		b.NumAccepted = nil
	}
	if b.RefeedHiddens = refeeds.optional(); b.RefeedHiddens == nil {
		b.RefeedRows = nil
	}
	if b.Bitmasks = masks.optional(); b.Bitmasks == nil {
		b.BitmaskRows = nil
	}
	if !floors {
		b.MinConfidence = nil
	}
	if !numbered {
		b.StepNumbers = nil
	}
	if !chosen {
		b.DraftCaps, b.VerifyTokenCosts = nil, nil
	}
	return b, nil
}

// rows gathers the rows of one tensor column, state by state.
type rows struct {
	dtype pb.DType
	width int64
	parts []Tensor // each [n, width] (one row may have come flat)
	count int64
}

// add appends t's rows (t nil: none) and returns how many; with pad, rows of other widths are
// made as wide as the widest with zero words.
func (r *rows) add(t *Tensor, pad bool) (int, error) {
	if t == nil {
		return 0, nil
	}
	n, width := int64(1), int64(0)
	switch len(t.Shape) {
	case 1:
		width = t.Shape[0]
		if width == 0 {
			n = 0
		}
	case 2:
		n, width = t.Shape[0], t.Shape[1]
	default:
		return 0, fmt.Errorf("shape %v: [n, width] or one row flat expected", t.Shape)
	}
	if n == 0 {
		return 0, nil
	}
	if r.count > 0 && t.DType != r.dtype {
		return 0, fmt.Errorf("dtype %v, where earlier rows are %v", t.DType, r.dtype)
	}
	if r.count > 0 && width != r.width && !pad {
		return 0, fmt.Errorf("%d values a row, where earlier rows hold %d", width, r.width)
	}
	if width > r.width {
		r.width = width
	}
	r.dtype = t.DType
	r.parts = append(r.parts, Tensor{t.DType, []int64{n, width}, t.Data})
	r.count += n
	return int(n), nil
}

// tensor is the rows as one [count, width] tensor.
func (r *rows) tensor() Tensor {
	size := int64(ItemSize(r.dtype))
	data := make([]byte, 0, r.count*r.width*size)
	for _, p := range r.parts {
		n, width := p.Shape[0], p.Shape[1]
		for i := int64(0); i < n; i++ {
			data = append(data, p.Data[i*width*size:(i+1)*width*size]...)
			data = append(data, make([]byte, (r.width-width)*size)...) // zero words
		}
	}
	return Tensor{r.dtype, []int64{r.count, r.width}, data}
}

// optional is tensor, or nil when there are no rows.
func (r *rows) optional() *Tensor {
	if r.count == 0 {
		return nil
	}
	t := r.tensor()
	return &t
}

// BatchResult is the answer to a batch, as columns: row i is StateIDs[i]'s.
type BatchResult struct {
	// StateIDs are the batch's, as it named them.
	StateIDs []uint64
	// Width is the number of columns of Drafts and Probs: the largest K asked.
	Width int
	// Drafts is [B, Width] row-major: row i's Counts[i] drafts, then -1.
	Drafts []int32
	// Probs is [B, Width] row-major: each draft's top-1 probability, then 0.
	Probs []float32
	// Counts is the number of drafts in each row: fewer than K when MinConfidence stopped the
	// chain, 0 for a row that failed.
	Counts []int32
	// Confidences is each row's chain confidence, as a Proposal's.
	Confidences []float32
	// FirstPositions is the position of each row's first draft.
	FirstPositions []int64
	// Errors holds the rows that failed, by row: each a status error with the code and
	// ErrorInfo reason a unary Propose would have returned, and the column at fault, if any,
	// as its field (ErrorDetails reads both). A failed row's state is unchanged. Nil when
	// every row was answered.
	Errors map[int]error
	// With ReturnBitmasks: each row's number of Bitmasks rows (Counts[i] + 1 for a state with
	// a grammar, else 0), and those rows, [sum(BitmaskRows), words] int32 (a Proposal's
	// Bitmasks, row by row).
	BitmaskRows []int32
	Bitmasks    *pb.Tensor
	// When some row's drafts were sampled: each draft's q as its QSupport most probable ids
	// and their probabilities, [B, Width, QSupport] row-major (a greedy row's q is its draft
	// alone at 1; past a row's count, 0). QSupport 0 and both empty when no row was sampled.
	QSupport int
	QIDs     []int32
	QProbs   []float32
}

// Len is the number of rows, B.
func (r *BatchResult) Len() int { return len(r.Counts) }

// Row is row i's drafts and their probabilities (Counts[i] of each; none if the row failed).
func (r *BatchResult) Row(i int) (drafts []int32, probs []float32) {
	lo := i * r.Width
	hi := lo + int(r.Counts[i])
	return r.Drafts[lo:hi], r.Probs[lo:hi]
}

// Proposal is row i as a Proposal, or the row's error if it failed.
func (r *BatchResult) Proposal(i int) (*pb.Proposal, error) {
	if err := r.Errors[i]; err != nil {
		return nil, err
	}
	drafts, probs := r.Row(i)
	p := &pb.Proposal{StateId: r.StateIDs[i], Tokens: drafts, Probs: probs,
		Confidence: r.Confidences[i], FirstPosition: r.FirstPositions[i]}
	if r.QSupport > 0 {
		lo := i * r.Width * r.QSupport
		hi := lo + len(drafts)*r.QSupport
		p.QSupport, p.QIds, p.QProbs = int32(r.QSupport), r.QIDs[lo:hi], r.QProbs[lo:hi]
	}
	return p, nil
}

// ProposeBatch runs a verifier's whole step in one call: for each of B states, the verdict on
// its pending proposal, then its next proposal. A row that fails has its error in Errors and
// leaves its state unchanged; the other rows are answered. A batch whose columns do not fit
// together (lengths, tensor shapes) fails the call with INVALID_ARGUMENT and changes nothing.
func (c *Client) ProposeBatch(ctx context.Context, b Batch) (*BatchResult, error) {
	req := batchRequest(b)
	resp, err := c.stub.ProposeBatch(ctx, req)
	if err != nil {
		return nil, err
	}
	return batchResult(resp, req.StateIds)
}

func batchRequest(b Batch) *pb.ProposeBatchRequest {
	req := &pb.ProposeBatchRequest{
		StateIds:      b.StateIDs,
		Tokens:        b.Tokens,
		Positions:     b.Positions,
		NumDrafts:     b.NumDrafts,
		NumAccepted:   b.NumAccepted,
		RefeedRows:    b.RefeedRows,
		RefeedHiddens: b.RefeedHiddens.message(),
		BitmaskRows:   b.BitmaskRows,
		Bitmasks:      b.Bitmasks.message(),
		MinConfidence: b.MinConfidence,
		StepNumbers:   b.StepNumbers,
		SamplingRows:  b.SamplingRows,
		Sampling:      b.Sampling,
		GrammarRows:   b.GrammarRows,
		Grammars:      b.Grammars,

		DraftCaps:        b.DraftCaps,
		VerifyTokenCosts: b.VerifyTokenCosts,
		ReturnBitmasks:   b.ReturnBitmasks,
	}
	if h := b.Hiddens; h.DType != pb.DType_DTYPE_UNSPECIFIED || h.Shape != nil || h.Data != nil {
		req.Hiddens = h.message() // a zero Tensor is sent as absent
	}
	return req
}

// batchResult checks that the answer's columns fit together, so that Row cannot go out of range.
func batchResult(resp *pb.ProposeBatchResponse, stateIDs []uint64) (*BatchResult, error) {
	size, width := len(resp.DraftCounts), int(resp.Width)
	if width < 0 || len(resp.Drafts) != size*width || len(resp.Probs) != size*width ||
		len(resp.Confidences) != size || len(resp.FirstPositions) != size || len(stateIDs) != size {
		return nil, fmt.Errorf("drafter: malformed ProposeBatchResponse: width %d, %d counts, %d drafts, "+
			"%d probs, %d confidences, %d first positions for %d states", width, size, len(resp.Drafts),
			len(resp.Probs), len(resp.Confidences), len(resp.FirstPositions), len(stateIDs))
	}
	support := int(resp.QSupport)
	if support < 0 || len(resp.QIds) != size*width*support || len(resp.QProbs) != size*width*support {
		return nil, fmt.Errorf("drafter: malformed ProposeBatchResponse: q support %d, %d q ids and %d q probs "+
			"for %d rows of width %d", support, len(resp.QIds), len(resp.QProbs), size, width)
	}
	for i, n := range resp.DraftCounts {
		if n < 0 || int(n) > width {
			return nil, fmt.Errorf("drafter: malformed ProposeBatchResponse: row %d counts %d drafts of %d", i, n, width)
		}
	}
	r := &BatchResult{StateIDs: stateIDs, Width: width, Drafts: resp.Drafts, Probs: resp.Probs,
		Counts: resp.DraftCounts, Confidences: resp.Confidences, FirstPositions: resp.FirstPositions,
		BitmaskRows: resp.BitmaskRows, Bitmasks: resp.Bitmasks,
		QSupport: support, QIDs: resp.QIds, QProbs: resp.QProbs}
	for _, e := range resp.Errors {
		if r.Errors == nil {
			r.Errors = map[int]error{}
		}
		r.Errors[int(e.Row)] = errorValue(e.GetError())
	}
	return r, nil
}
