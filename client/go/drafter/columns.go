package drafter

import (
	"context"
	"fmt"

	pb "github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
)

// Columns is a verifier's whole step for B states, as columns: row i of every column belongs to
// StateIDs[i]. Optional columns are left empty (nil); NumDrafts and MinConfidence may also hold
// one value for every state.
type Columns struct {
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
}

// ColumnsResult is the answer to a step, as columns: row i is Columns.StateIDs[i]'s.
type ColumnsResult struct {
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
}

// Len is the number of rows, B.
func (r *ColumnsResult) Len() int { return len(r.Counts) }

// Row is row i's drafts and their probabilities (Counts[i] of each; none if the row failed).
func (r *ColumnsResult) Row(i int) (drafts []int32, probs []float32) {
	lo := i * r.Width
	hi := lo + int(r.Counts[i])
	return r.Drafts[lo:hi], r.Probs[lo:hi]
}

// ProposeColumns runs a verifier's whole step in one call: for each of B states, the verdict on
// its pending proposal, then its next proposal. A row that fails has its error in Errors and
// leaves its state unchanged; the other rows are answered. A step whose columns do not fit
// together (lengths, tensor shapes) fails the call with INVALID_ARGUMENT and changes nothing.
func (c *Client) ProposeColumns(ctx context.Context, cols Columns) (*ColumnsResult, error) {
	resp, err := c.stub.ProposeColumns(ctx, columnsRequest(cols))
	if err != nil {
		return nil, err
	}
	return columnsResult(resp)
}

func columnsRequest(cols Columns) *pb.ColumnsRequest {
	req := &pb.ColumnsRequest{
		StateIds:      cols.StateIDs,
		Tokens:        cols.Tokens,
		Positions:     cols.Positions,
		NumDrafts:     cols.NumDrafts,
		NumAccepted:   cols.NumAccepted,
		RefeedRows:    cols.RefeedRows,
		RefeedHiddens: cols.RefeedHiddens.message(),
		BitmaskRows:   cols.BitmaskRows,
		Bitmasks:      cols.Bitmasks.message(),
		MinConfidence: cols.MinConfidence,
	}
	if h := cols.Hiddens; h.DType != pb.DType_DTYPE_UNSPECIFIED || h.Shape != nil || h.Data != nil {
		req.Hiddens = h.message() // a zero Tensor is sent as absent
	}
	return req
}

// columnsResult checks that the answer's columns fit together, so that Row cannot go out of range.
func columnsResult(resp *pb.ColumnsResponse) (*ColumnsResult, error) {
	size, width := len(resp.DraftCounts), int(resp.Width)
	if width < 0 || len(resp.Drafts) != size*width || len(resp.Probs) != size*width ||
		len(resp.Confidences) != size || len(resp.FirstPositions) != size {
		return nil, fmt.Errorf("drafter: malformed ColumnsResponse: width %d, %d counts, %d drafts, "+
			"%d probs, %d confidences, %d first positions", width, size, len(resp.Drafts),
			len(resp.Probs), len(resp.Confidences), len(resp.FirstPositions))
	}
	for i, n := range resp.DraftCounts {
		if n < 0 || int(n) > width {
			return nil, fmt.Errorf("drafter: malformed ColumnsResponse: row %d counts %d drafts of %d", i, n, width)
		}
	}
	r := &ColumnsResult{Width: width, Drafts: resp.Drafts, Probs: resp.Probs, Counts: resp.DraftCounts,
		Confidences: resp.Confidences, FirstPositions: resp.FirstPositions}
	for _, e := range resp.Errors {
		if r.Errors == nil {
			r.Errors = map[int]error{}
		}
		r.Errors[int(e.Row)] = errorValue(e.GetError())
	}
	return r, nil
}

// ColumnsStream is ProposeColumns on one stream: one message per verifier step.
//
//	s, err := c.ProposeColumnsStream(context.Background()) // no deadline
//	defer s.Close()
//	r, err := s.Step(ctx, cols) // once per verifier step; ctx bounds this step only
//
// A ColumnsStream is safe for concurrent use; answers are matched by request id. A step that
// fails as a whole returns its status error (as a unary ProposeColumns would) and leaves the
// stream open.
type ColumnsStream struct {
	call pb.Drafter_ProposeColumnsStreamClient
	x    *exchange
}

// ProposeColumnsStream opens a ProposeColumnsStream. Cancelling ctx ends it (and fails what is
// in flight); as for OpenStream, ctx's deadline is the whole stream's (none unless ctx has one).
func (c *Client) ProposeColumnsStream(ctx context.Context) (*ColumnsStream, error) {
	ctx, cancel := context.WithCancel(ctx)
	call, err := c.stub.ProposeColumnsStream(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	s := &ColumnsStream{call: call}
	s.x = newExchange(cancel, call.CloseSend, func() (uint64, answer, error) {
		resp, err := call.Recv()
		if err != nil {
			return 0, answer{}, err
		}
		if e := resp.GetError(); e != nil {
			return resp.RequestId, answer{err: errorValue(e)}, nil
		}
		r, err := columnsResult(resp)
		return resp.RequestId, answer{value: r, err: err}, nil
	})
	return s, nil
}

// Step sends one step and waits for its answer, as ProposeColumns. If ctx ends first, Step
// returns its error; the server may still make the proposals.
func (s *ColumnsStream) Step(ctx context.Context, cols Columns) (*ColumnsResult, error) {
	v, err := s.x.roundTrip(ctx, func(id uint64) error {
		req := columnsRequest(cols)
		req.RequestId = id
		return s.call.Send(req)
	})
	if err != nil {
		return nil, err
	}
	return v.(*ColumnsResult), nil
}

// Close ends the writing side, waits for the answers still owed and for the end of the call,
// and returns the call's error (nil when it ended cleanly). Later Steps fail with UNAVAILABLE.
func (s *ColumnsStream) Close() error { return s.x.close() }
