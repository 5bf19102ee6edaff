// Package drafter is a Go client of the mtpdraft.v1.Drafter gRPC service: speculative-decoding
// draft tokens from an MTP head, served remotely.
//
//	c, err := drafter.Dial("localhost:50051")
//	state, err := c.AllocState(ctx)
//	_, err = c.Prefill(ctx, state, 1, tokens, drafter.FP32(hiddens, n, hiddenSize), 0)
//	p, err := c.Propose(ctx, state, drafter.ProposeArgs{Token: t, Hidden: drafter.FP32(h), Position: pos, NumDrafts: 3})
//	_, err = c.AfterVerify(ctx, state, accepted, nil)
//	_, err = c.FreeState(ctx, state)
//
// A verifier that steps many states at once sends the whole step as one message of columns
// (ProposeBatch, or Step on a Stream): one row per state, the hiddens as one [B, hidden]
// tensor, and the drafts back as a [B, width] slice, with an error per failed row (BatchOf
// makes the columns from states given one by one). In a decode loop, a Stream (OpenStream)
// spends one round trip per verify step: each state's verdict on its last proposal
// (NumAccepted, or Previous of a Stream's Propose, a batch of one) rides with the step instead of
// a separate AfterVerify.
//
// Deadlines are the contexts': each call's ctx bounds that call, and the ctx a stream is opened
// with bounds the whole stream. The client sets none of its own, so a stream opened with
// context.Background() has no deadline.
//
// Behind a proxy in front of several replicas, every call names the verifier's affinity key
// (WithAffinityKey(ctx, key), a stream's when it is opened): all of a key's calls reach one
// replica. A state whose replica is gone answers codes.NotFound with ErrorDetails' reason
// "STATE_LOST": allocate a new state, prefill its committed rows, propose again without a
// verdict (deploy/README.md).
//
// Tensors are raw little-endian bytes with a dtype and a shape. Errors are gRPC status errors:
// status.Code(err) is codes.NotFound, codes.InvalidArgument, codes.FailedPrecondition, ...
package drafter

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	pb "github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
)

// DefaultChunkBytes bounds one PrefillChunk when Prefill is given no chunk size.
const DefaultChunkBytes = 4 << 20

// AffinityHeader is the request metadata a proxy (or gRPC's ring_hash policy) routes by.
const AffinityHeader = "x-mtpdraft-affinity"

// WithAffinityKey is ctx carrying key as the affinity metadata of the calls made with it.
func WithAffinityKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, AffinityHeader, key)
}

// Tensor is a dense tensor: raw little-endian bytes in row-major order, a dtype and a shape.
type Tensor struct {
	DType pb.DType
	Shape []int64
	Data  []byte
}

// ItemSize is the size in bytes of one element of a dtype (0 if unknown).
func ItemSize(d pb.DType) int {
	switch d {
	case pb.DType_DTYPE_BF16, pb.DType_DTYPE_FP16:
		return 2
	case pb.DType_DTYPE_FP32, pb.DType_DTYPE_INT32:
		return 4
	}
	return 0
}

// FP32 is an fp32 tensor of the values with the given shape (default: [len(values)]).
func FP32(values []float32, shape ...int64) Tensor {
	data := make([]byte, 4*len(values))
	for i, v := range values {
		binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(v))
	}
	return Tensor{pb.DType_DTYPE_FP32, shapeOr(shape, len(values)), data}
}

// BF16 is a bfloat16 tensor of the values (rounded to nearest even) with the given shape.
func BF16(values []float32, shape ...int64) Tensor {
	data := make([]byte, 2*len(values))
	for i, v := range values {
		bits := math.Float32bits(v)
		if v != v {
			bits |= 0x00400000 // a quiet NaN: its payload may lie in the bits dropped
		} else {
			bits += 0x7FFF + (bits>>16)&1
		}
		binary.LittleEndian.PutUint16(data[2*i:], uint16(bits>>16))
	}
	return Tensor{pb.DType_DTYPE_BF16, shapeOr(shape, len(values)), data}
}

// Int32 is an int32 tensor (e.g. an xgrammar bitmask of shape [words] or [rows, words]).
func Int32(values []int32, shape ...int64) Tensor {
	data := make([]byte, 4*len(values))
	for i, v := range values {
		binary.LittleEndian.PutUint32(data[4*i:], uint32(v))
	}
	return Tensor{pb.DType_DTYPE_INT32, shapeOr(shape, len(values)), data}
}

func shapeOr(shape []int64, n int) []int64 {
	if len(shape) == 0 {
		return []int64{int64(n)}
	}
	return shape
}

func (t *Tensor) message() *pb.Tensor {
	if t == nil {
		return nil
	}
	return &pb.Tensor{Dtype: t.DType, Shape: t.Shape, Data: t.Data}
}

// Rows is a state's size after a call: the rows it holds and the position the next row must have.
type Rows struct {
	NumRows      int64
	NextPosition int64
}

// PrefillResult is Rows plus the number of chunks the stream carried.
type PrefillResult struct {
	Rows
	Chunks int
}

// Verdict is the verifier's verdict on a pending proposal: the first NumAccepted drafts were
// accepted; RefeedHiddens (optional, [NumAccepted, hidden]) are the target's hiddens for them.
type Verdict struct {
	NumAccepted   int32
	RefeedHiddens *Tensor
}

// ProposeArgs are the inputs of Propose. Hidden is the target hidden at Position - 1.
type ProposeArgs struct {
	Token         int32
	Hidden        Tensor
	Position      int64
	NumDrafts     int32
	Bitmask       *Tensor  // optional xgrammar packed int32 bitmask
	MinConfidence float32  // 0: draft all NumDrafts
	Previous      *Verdict // optional: the fused AfterVerify of the pending proposal
	// StepNumber numbers the state's steps in increasing order (0: not numbered): a step sent
	// again with its number while its proposal is pending is answered as it was, applied once,
	// so a step whose outcome is unknown (DeadlineExceeded, Unavailable) is safe to resend.
	StepNumber uint64
	// ReturnBitmasks asks, for a state with a grammar, for the grammar's bitmask at each
	// draft's position and the bonus position (the Proposal's Bitmasks).
	ReturnBitmasks bool
	// Sampling, if set, is the state's sampling from this step on (see StateOptions).
	Sampling *pb.SamplingParams
	// Grammar, if set, is the state's grammar from this step's token on (NoGrammar: none
	// from this step on; nil: the state keeps its own).
	Grammar *pb.Grammar
	// With NumDrafts 0 the drafter chooses K, up to DraftCap (0: GetInfo's MaxDrafts), for the
	// most tokens per unit of verify cost: VerifyTokenCost is what verifying one more token
	// costs, as a fraction of a verify step.
	DraftCap        int32
	VerifyTokenCost float32
}

// Client wraps the generated stub. It is safe for concurrent use.
type Client struct {
	conn *grpc.ClientConn
	stub pb.DrafterClient
}

// Dial opens an insecure connection to address unless opts says otherwise.
func Dial(address string, opts ...grpc.DialOption) (*Client, error) {
	if len(opts) == 0 {
		opts = []grpc.DialOption{grpc.WithInsecure()}
	}
	conn, err := grpc.Dial(address, opts...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, stub: pb.NewDrafterClient(conn)}, nil
}

// New wraps an existing connection (which Close then closes).
func New(conn *grpc.ClientConn) *Client {
	return &Client{conn: conn, stub: pb.NewDrafterClient(conn)}
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Stub is the generated client, for calls with options this wrapper does not take.
func (c *Client) Stub() pb.DrafterClient { return c.stub }

// GetInfo returns the model shape, limits and live counters.
func (c *Client) GetInfo(ctx context.Context) (*pb.GetInfoResponse, error) {
	return c.stub.GetInfo(ctx, &pb.GetInfoRequest{})
}

// AllocState returns the id of a new, empty state.
func (c *Client) AllocState(ctx context.Context) (uint64, error) {
	return c.AllocStateWith(ctx, StateOptions{})
}

// AllocStateWithGrammar returns the id of a new, empty state whose every draft obeys grammar
// (JSONSchema, EBNF, Regex or StructuralTag make one; nil: none). GetInfo's GrammarKinds
// lists the kinds the server takes.
func (c *Client) AllocStateWithGrammar(ctx context.Context, grammar *pb.Grammar) (uint64, error) {
	return c.AllocStateWith(ctx, StateOptions{Grammar: grammar})
}

// StateOptions are how a new state drafts; the zero value is greedy, without a grammar.
type StateOptions struct {
	// Sampling draws each draft from q, the head's distribution after vLLM's temperature,
	// min_p, top_k and top_p, cut to GetInfo's MaxSampleTopK tokens; the answers then carry
	// q (Proposal.QIds, BatchResult.QIDs), which Accept and AcceptBatch take. A draw depends
	// only on (Seed, state, position, draft index). Nil or temperature 0: greedy.
	Sampling *pb.SamplingParams
	// Grammar is what every draft obeys (nil: none).
	Grammar *pb.Grammar
}

// AllocStateWith returns the id of a new, empty state that drafts as opts says.
func (c *Client) AllocStateWith(ctx context.Context, opts StateOptions) (uint64, error) {
	r, err := c.stub.AllocState(ctx, &pb.AllocStateRequest{Sampling: opts.Sampling, Grammar: opts.Grammar})
	if err != nil {
		return 0, err
	}
	return r.StateId, nil
}

// JSONSchema is a grammar: a JSON schema, as JSON text.
func JSONSchema(schema string) *pb.Grammar {
	return &pb.Grammar{Kind: &pb.Grammar_JsonSchema{JsonSchema: schema}}
}

// EBNF is a grammar in xgrammar's EBNF dialect, with a rule named root.
func EBNF(ebnf string) *pb.Grammar { return &pb.Grammar{Kind: &pb.Grammar_Ebnf{Ebnf: ebnf}} }

// Regex is a grammar: a regular expression the whole output matches.
func Regex(regex string) *pb.Grammar { return &pb.Grammar{Kind: &pb.Grammar_Regex{Regex: regex}} }

// StructuralTag is a grammar: a structural tag, as JSON text (xgrammar's format).
func StructuralTag(tag string) *pb.Grammar {
	return &pb.Grammar{Kind: &pb.Grammar_StructuralTag{StructuralTag: tag}}
}

// NoGrammar is no grammar: on a Propose (ProposeArgs.Grammar, a batch's Grammars), the
// state's grammar is cleared from that step on.
func NoGrammar() *pb.Grammar { return &pb.Grammar{Kind: &pb.Grammar_None{None: true}} }

// Prefill appends committed rows (tokens[i], hiddens row i) at startPosition + i, streamed in
// chunks of chunkRows rows (0: as many as fit in DefaultChunkBytes). All or nothing.
func (c *Client) Prefill(ctx context.Context, state uint64, startPosition int64, tokens []int32,
	hiddens Tensor, chunkRows int) (PrefillResult, error) {
	if len(hiddens.Shape) != 2 || hiddens.Shape[0] != int64(len(tokens)) {
		return PrefillResult{}, fmt.Errorf("drafter: hiddens shape %v does not match %d tokens",
			hiddens.Shape, len(tokens))
	}
	width := hiddens.Shape[1]
	rowBytes := int(width) * ItemSize(hiddens.DType)
	if chunkRows <= 0 {
		chunkRows = max1((DefaultChunkBytes - 64) / (rowBytes + 5))
	}
	stream, err := c.stub.Prefill(ctx)
	if err != nil {
		return PrefillResult{}, err
	}
	chunks := 0
	for lo := 0; lo < len(tokens) || lo == 0; lo += chunkRows {
		hi := lo + chunkRows
		if hi > len(tokens) {
			hi = len(tokens)
		}
		chunk := &pb.PrefillChunk{
			Tokens: tokens[lo:hi],
			Hiddens: &pb.Tensor{Dtype: hiddens.DType, Shape: []int64{int64(hi - lo), width},
				Data: hiddens.Data[lo*rowBytes : hi*rowBytes]},
		}
		if lo == 0 { // the first chunk names the state, the start and the row count
			// (so that a stream cut short is rolled back); later ones continue it
			chunk.StateId, chunk.StartPosition = state, startPosition
			chunk.TotalRows = int64(len(tokens))
		}
		if err := stream.Send(chunk); err != nil {
			break // the server ended the call: CloseAndRecv returns its status
		}
		chunks++
	}
	r, err := stream.CloseAndRecv()
	if err != nil {
		return PrefillResult{}, err
	}
	return PrefillResult{Rows{r.NumRows, r.NextPosition}, chunks}, nil
}

func max1(n int) int {
	if n < 1 {
		return 1
	}
	return n
}

func verdict(v *Verdict) *pb.Verdict {
	if v == nil {
		return nil
	}
	return &pb.Verdict{NumAccepted: v.NumAccepted, RefeedHiddens: v.RefeedHiddens.message()}
}

// Propose appends the row of args.Token and returns up to args.NumDrafts drafts with their
// probabilities and the chain confidence. The proposal then awaits AfterVerify (or a Propose
// whose Previous carries the verdict).
func (c *Client) Propose(ctx context.Context, state uint64, args ProposeArgs) (*pb.Proposal, error) {
	return c.stub.Propose(ctx, proposeRequest(state, args))
}

func proposeRequest(state uint64, args ProposeArgs) *pb.ProposeRequest {
	return &pb.ProposeRequest{
		StateId:       state,
		Token:         args.Token,
		Hidden:        args.Hidden.message(),
		Position:      args.Position,
		NumDrafts:     args.NumDrafts,
		Bitmask:       args.Bitmask.message(),
		MinConfidence: args.MinConfidence,
		Previous:      verdict(args.Previous),
		StepNumber:    args.StepNumber,

		ReturnBitmasks:  args.ReturnBitmasks,
		Sampling:        args.Sampling,
		Grammar:         args.Grammar,
		DraftCap:        args.DraftCap,
		VerifyTokenCost: args.VerifyTokenCost,
	}
}

// AfterVerify tells the state that the first numAccepted drafts were accepted; refeed
// (optional, [numAccepted, hidden]) recomputes their rows with the target's hiddens.
func (c *Client) AfterVerify(ctx context.Context, state uint64, numAccepted int32, refeed *Tensor) (Rows, error) {
	r, err := c.stub.AfterVerify(ctx, &pb.AfterVerifyRequest{
		StateId: state, Verdict: verdict(&Verdict{numAccepted, refeed}),
	})
	if err != nil {
		return Rows{}, err
	}
	return Rows{r.NumRows, r.NextPosition}, nil
}

// TakeKV detaches the state's KV into a handle; the state stays allocated and empty.
func (c *Client) TakeKV(ctx context.Context, state uint64) (*pb.TakeKVResponse, error) {
	return c.stub.TakeKV(ctx, &pb.TakeKVRequest{StateId: state})
}

// InstallKV installs a handle's KV into an empty state, consuming the handle.
func (c *Client) InstallKV(ctx context.Context, state, handle uint64) (Rows, error) {
	r, err := c.stub.InstallKV(ctx, &pb.InstallKVRequest{StateId: state, HandleId: handle})
	if err != nil {
		return Rows{}, err
	}
	return Rows{r.NumRows, r.NextPosition}, nil
}

// FreeState releases the state and reports whether it existed. Idempotent.
func (c *Client) FreeState(ctx context.Context, state uint64) (bool, error) {
	r, err := c.stub.FreeState(ctx, &pb.FreeStateRequest{StateId: state})
	if err != nil {
		return false, err
	}
	return r.Existed, nil
}
