package drafter

import (
	"context"
	"errors"
	"io"
	"sync"

	"github.com/golang/protobuf/proto"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
)

// errorDomain is the ErrorInfo domain of the service's errors.
const errorDomain = "mtpdraft.v1"

// Stream is the hot path: one ProposeStream per verifier, one message per verify step. Each
// message is a batch of the verifier's states (Step), usually carrying each state's verdict on
// its last proposal, so a verify step costs one round trip; Propose sends one state as a batch
// of one:
//
//	s, err := c.OpenStream(context.Background()) // no deadline: the stream is the verifier's
//	defer s.Close()
//	r, err := s.Step(ctx, batch) // once per verifier step; ctx bounds this step only
//	p, err := s.Propose(ctx, state, drafter.ProposeArgs{..., Previous: &drafter.Verdict{NumAccepted: a}})
//
// A Stream is safe for concurrent use: many batches may be in flight at once, and two naming one
// state are served in the order sent; answers are matched by request id. A failed row has its
// error in the result's Errors; a message that fails as a whole returns its status error (the
// code and ErrorInfo reason a unary ProposeBatch would have returned) and leaves the stream open.
type Stream struct {
	call pb.Drafter_ProposeStreamClient
	x    *exchange
}

// OpenStream opens a ProposeStream. Cancelling ctx ends it (and fails what is in flight), and
// ctx's deadline is the whole stream's: a stream has none unless ctx has one. Open a stream kept
// for a verifier's life with context.Background() (or a context.WithCancel of it) and bound each
// Step by its own ctx instead, which ends that step's wait only.
func (c *Client) OpenStream(ctx context.Context) (*Stream, error) {
	ctx, cancel := context.WithCancel(ctx)
	call, err := c.stub.ProposeStream(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	s := &Stream{call: call}
	s.x = newExchange(cancel, call.CloseSend, func() (uint64, answer, error) {
		resp, err := call.Recv()
		if err != nil {
			return 0, answer{}, err
		}
		return resp.RequestId, answer{value: resp}, nil
	})
	return s, nil
}

// Step sends one batch and waits for its answer, as ProposeBatch. If ctx ends first, Step
// returns its error (the stream stays open); the server may still make the proposals.
func (s *Stream) Step(ctx context.Context, b Batch) (*BatchResult, error) {
	req := batchRequest(b)
	v, err := s.x.roundTrip(ctx, func(id uint64) error {
		req.RequestId = id
		return s.call.Send(req)
	})
	if err != nil {
		return nil, err
	}
	resp := v.(*pb.ProposeBatchResponse)
	if e := resp.GetError(); e != nil {
		return nil, errorValue(e)
	}
	return batchResult(resp, req.StateIds)
}

// Propose sends one state as a batch of one and waits for its answer: the drafts, or the
// state's error.
func (s *Stream) Propose(ctx context.Context, state uint64, args ProposeArgs) (*pb.Proposal, error) {
	b, err := BatchOf([]BatchRequest{{state, args}})
	if err != nil {
		return nil, err
	}
	r, err := s.Step(ctx, b)
	if err != nil {
		return nil, err
	}
	return r.Proposal(0)
}

// Close ends the writing side, waits for the answers still owed and for the end of the call,
// and returns the call's error (nil when it ended cleanly). Later Steps fail with UNAVAILABLE.
func (s *Stream) Close() error { return s.x.close() }

// exchange carries the requests of a bidirectional stream whose answers name their request id:
// it numbers the requests, and a reader hands each answer to the request waiting for it.
type exchange struct {
	cancel    context.CancelFunc
	closeSend func() error
	sendMu    sync.Mutex // grpc-go lets one goroutine at a time Send

	mu      sync.Mutex
	nextID  uint64
	pending map[uint64]chan answer
	ended   error         // why the stream ended (io.EOF: closed by the server after CloseSend)
	done    chan struct{} // closed once the reader has stopped
}

// answer is a request's outcome: its result, or its error.
type answer struct {
	value interface{}
	err   error
}

// newExchange starts the reader: recv returns the next answer and its request id, or the error
// that ended the stream.
func newExchange(cancel context.CancelFunc, closeSend func() error,
	recv func() (uint64, answer, error)) *exchange {
	x := &exchange{cancel: cancel, closeSend: closeSend, pending: map[uint64]chan answer{},
		done: make(chan struct{})}
	go x.read(recv)
	return x
}

// roundTrip sends one request under a new id and waits for its answer, or for ctx to end.
func (x *exchange) roundTrip(ctx context.Context, send func(id uint64) error) (interface{}, error) {
	reply := make(chan answer, 1)
	x.mu.Lock()
	if x.ended != nil {
		x.mu.Unlock()
		return nil, x.closedError()
	}
	x.nextID++
	id := x.nextID
	x.pending[id] = reply
	x.mu.Unlock()

	x.sendMu.Lock()
	err := send(id)
	x.sendMu.Unlock()
	if err != nil && !errors.Is(err, io.EOF) {
		x.forget(id)
		return nil, err
	}
	// On io.EOF the stream has ended: the reader learns why and fails every pending request.
	select {
	case a := <-reply:
		return a.value, a.err
	case <-ctx.Done():
		x.forget(id)
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// close ends the writing side, waits for the reader to stop and returns the call's error.
func (x *exchange) close() error {
	x.sendMu.Lock()
	x.closeSend()
	x.sendMu.Unlock()
	<-x.done
	x.cancel()
	x.mu.Lock()
	defer x.mu.Unlock()
	if errors.Is(x.ended, io.EOF) {
		return nil
	}
	return x.ended
}

func (x *exchange) read(recv func() (uint64, answer, error)) {
	defer close(x.done)
	for {
		id, a, err := recv()
		if err != nil {
			x.end(err)
			return
		}
		x.mu.Lock()
		reply, ok := x.pending[id]
		delete(x.pending, id)
		x.mu.Unlock()
		if ok {
			reply <- a
		}
	}
}

// end records why the stream ended and fails every request still waiting.
func (x *exchange) end(err error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.ended = err
	for id, reply := range x.pending {
		reply <- answer{err: x.closedError()}
		delete(x.pending, id)
	}
}

// closedError is the error of a request the ended stream cannot answer (x.mu held).
func (x *exchange) closedError() error {
	if errors.Is(x.ended, io.EOF) {
		return status.Error(codes.Unavailable, "the propose stream is closed")
	}
	return x.ended
}

func (x *exchange) forget(id uint64) {
	x.mu.Lock()
	delete(x.pending, id)
	x.mu.Unlock()
}

// errorValue turns an error carried as a value (a failed row, a stream message's error) into the
// status error a unary call would have returned: its code and message, the reason as an
// ErrorInfo detail and the field, if any, as a BadRequest one.
func errorValue(e *pb.Error) error {
	st := status.New(codes.Code(e.Code), e.Message)
	details := []proto.Message{&errdetails.ErrorInfo{Reason: e.Reason, Domain: errorDomain}}
	if e.Field != "" {
		violation := &errdetails.BadRequest_FieldViolation{Field: e.Field, Description: e.Message}
		details = append(details, &errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{violation}})
	}
	if withDetails, err := st.WithDetails(details...); err == nil {
		st = withDetails
	}
	return st.Err()
}

// ErrorDetails is a status error's machine-readable reason (its ErrorInfo detail) and the
// request field at fault (its first BadRequest field violation), each "" when absent.
func ErrorDetails(err error) (reason, field string) {
	st, ok := status.FromError(err)
	if !ok {
		return "", ""
	}
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			reason = d.Reason
		case *errdetails.BadRequest:
			if len(d.FieldViolations) > 0 && field == "" {
				field = d.FieldViolations[0].Field
			}
		}
	}
	return reason, field
}
