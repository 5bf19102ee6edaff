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

	pb "mtpdraft/gen/mtpdraftv1"
)

// errorDomain is the ErrorInfo domain of the service's errors.
const errorDomain = "mtpdraft.v1"

// Stream is the hot path: one ProposeStream per verifier, one message per verify step. Each
// Propose usually carries args.Previous, the verdict on the state's last proposal, so a verify
// step costs one round trip:
//
//	s, err := c.OpenStream(ctx)
//	defer s.Close()
//	p, err := s.Propose(ctx, state, drafter.ProposeArgs{..., Previous: &drafter.Verdict{NumAccepted: a}})
//
// A Stream is safe for concurrent use: many states may share it, with requests in flight at
// once; answers are matched by request id. A refused request returns its status error (the same
// code and ErrorInfo reason as a unary Propose) and leaves the stream open.
type Stream struct {
	call   pb.Drafter_ProposeStreamClient
	cancel context.CancelFunc
	sendMu sync.Mutex // grpc-go lets one goroutine at a time Send

	mu      sync.Mutex
	nextID  uint64
	pending map[uint64]chan answer
	ended   error         // why the stream ended (io.EOF: closed by the server after CloseSend)
	done    chan struct{} // closed once the reader has stopped
}

type answer struct {
	proposal *pb.Proposal
	err      error
}

// OpenStream opens a ProposeStream. Cancelling ctx ends it (and fails what is in flight).
func (c *Client) OpenStream(ctx context.Context) (*Stream, error) {
	ctx, cancel := context.WithCancel(ctx)
	call, err := c.stub.ProposeStream(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	s := &Stream{call: call, cancel: cancel, pending: map[uint64]chan answer{}, done: make(chan struct{})}
	go s.read()
	return s, nil
}

// Propose sends one request and waits for its answer: the drafts, or the request's error. If ctx
// ends first, Propose returns its error; the server may still make the proposal.
func (s *Stream) Propose(ctx context.Context, state uint64, args ProposeArgs) (*pb.Proposal, error) {
	reply := make(chan answer, 1)
	s.mu.Lock()
	if s.ended != nil {
		s.mu.Unlock()
		return nil, s.closedError()
	}
	s.nextID++
	id := s.nextID
	s.pending[id] = reply
	s.mu.Unlock()

	req := proposeRequest(state, args)
	req.RequestId = id
	s.sendMu.Lock()
	err := s.call.Send(req)
	s.sendMu.Unlock()
	if err != nil && !errors.Is(err, io.EOF) {
		s.forget(id)
		return nil, err
	}
	// On io.EOF the stream has ended: the reader learns why and fails every pending request.
	select {
	case a := <-reply:
		return a.proposal, a.err
	case <-ctx.Done():
		s.forget(id)
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// Close ends the writing side, waits for the answers still owed and for the end of the call,
// and returns the call's error (nil when it ended cleanly). Later Proposes fail with UNAVAILABLE.
func (s *Stream) Close() error {
	s.sendMu.Lock()
	s.call.CloseSend()
	s.sendMu.Unlock()
	<-s.done
	s.cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	if errors.Is(s.ended, io.EOF) {
		return nil
	}
	return s.ended
}

func (s *Stream) read() {
	defer close(s.done)
	for {
		resp, err := s.call.Recv()
		if err != nil {
			s.end(err)
			return
		}
		s.mu.Lock()
		reply, ok := s.pending[resp.RequestId]
		delete(s.pending, resp.RequestId)
		s.mu.Unlock()
		if ok {
			reply <- outcome(resp)
		}
	}
}

// end records why the stream ended and fails every request still waiting.
func (s *Stream) end(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ended = err
	for id, reply := range s.pending {
		reply <- answer{err: s.closedError()}
		delete(s.pending, id)
	}
}

// closedError is the error of a request the ended stream cannot answer (s.mu held).
func (s *Stream) closedError() error {
	if errors.Is(s.ended, io.EOF) {
		return status.Error(codes.Unavailable, "the propose stream is closed")
	}
	return s.ended
}

func (s *Stream) forget(id uint64) {
	s.mu.Lock()
	delete(s.pending, id)
	s.mu.Unlock()
}

func outcome(resp *pb.ProposeStreamResponse) answer {
	if e := resp.GetError(); e != nil {
		return answer{err: errorValue(e)}
	}
	return answer{proposal: resp.GetProposal()}
}

// errorValue turns an error answer into the status error a unary call would have returned:
// its code and message, the reason as an ErrorInfo detail and the field as a BadRequest one.
func errorValue(e *pb.Error) error {
	st := status.New(codes.Code(e.Code), e.Message)
	details := []proto.Message{&errdetails.ErrorInfo{Reason: e.Reason, Domain: errorDomain}}
	if e.Field != "" && codes.Code(e.Code) == codes.InvalidArgument {
		violation := &errdetails.BadRequest_FieldViolation{Field: e.Field, Description: e.Message}
		details = append(details, &errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{violation}})
	}
	if withDetails, err := st.WithDetails(details...); err == nil {
		st = withDetails
	}
	return st.Err()
}
