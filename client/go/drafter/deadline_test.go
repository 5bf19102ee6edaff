package drafter

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	pb "github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
)

const (
	short = 200 * time.Millisecond // a Propose's own timeout, and an explicit stream's deadline
	past  = 500 * time.Millisecond // how long each stream is kept open before its next message
)

// echoDrafter answers every stream message at once: one draft a state, its token + 1.
type echoDrafter struct {
	pb.UnimplementedDrafterServer
}

func (echoDrafter) ProposeStream(s pb.Drafter_ProposeStreamServer) error {
	for {
		req, err := s.Recv()
		if err != nil {
			return nil
		}
		if err := s.Send(echo(req)); err != nil {
			return err
		}
	}
}

// echo is a batch's answer: one draft a state, its token + 1, at its position + 1.
func echo(req *pb.ProposeBatchRequest) *pb.ProposeBatchResponse {
	resp := &pb.ProposeBatchResponse{RequestId: req.RequestId, Width: 1}
	for i, token := range req.Tokens {
		resp.Drafts = append(resp.Drafts, token+1)
		resp.Probs = append(resp.Probs, 1)
		resp.DraftCounts = append(resp.DraftCounts, 1)
		resp.Confidences = append(resp.Confidences, 1)
		resp.FirstPositions = append(resp.FirstPositions, req.Positions[i]+1)
	}
	return resp
}

func echoClient(t *testing.T) *Client {
	listener := bufconn.Listen(1 << 20)
	server := grpc.NewServer()
	pb.RegisterDrafterServer(server, echoDrafter{})
	go server.Serve(listener)
	t.Cleanup(server.Stop)
	conn, err := grpc.Dial("bufnet", grpc.WithInsecure(),
		grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) { return listener.Dial() }))
	if err != nil {
		t.Fatal(err)
	}
	c := New(conn)
	t.Cleanup(func() { c.Close() })
	return c
}

// propose is one stream round trip bounded by its own short timeout.
func propose(s *Stream) error {
	ctx, cancel := context.WithTimeout(context.Background(), short)
	defer cancel()
	p, err := s.Propose(ctx, 7, ProposeArgs{Token: 1, Hidden: FP32([]float32{1, 2}), Position: 1, NumDrafts: 1})
	if err == nil && (len(p.Tokens) != 1 || p.Tokens[0] != 2 || p.StateId != 7 || p.FirstPosition != 2) {
		return status.Errorf(codes.Internal, "answer %v", p)
	}
	return err
}

func step(s *Stream) error {
	ctx, cancel := context.WithTimeout(context.Background(), short)
	defer cancel()
	_, err := s.Step(ctx, Batch{StateIDs: []uint64{7}, Tokens: []int32{1}, Positions: []int64{1},
		Hiddens: FP32([]float32{1, 2}, 1, 2), NumDrafts: []int32{1}})
	return err
}

// A stream opened with a context without a deadline has none: each request's own ctx bounds
// that request only, and the stream serves on past it.
func TestStreamsHaveNoDeadlineUnlessAsked(t *testing.T) {
	c := echoClient(t)
	s, err := c.OpenStream(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := propose(s); err != nil {
		t.Fatal(err)
	}
	time.Sleep(past)
	if err := propose(s); err != nil {
		t.Fatalf("the stream ended: %v", err)
	}
	if err := step(s); err != nil {
		t.Fatalf("the stream ended: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}

// A stream opened with a deadline ends with DEADLINE_EXCEEDED once it has passed.
func TestStreamWithDeadlineExpires(t *testing.T) {
	c := echoClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), short)
	defer cancel()
	s, err := c.OpenStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := propose(s); err != nil {
		t.Fatal(err)
	}
	time.Sleep(past)
	if err := propose(s); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("propose past the stream's deadline: %v", err)
	}
	if err := step(s); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("step past the stream's deadline: %v", err)
	}
	if err := s.Close(); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("close: %v", err)
	}
}

// keyDrafter answers AllocState with the affinity key it was sent, as a state id's digits.
type keyDrafter struct {
	echoDrafter
	keys chan string
}

func (d keyDrafter) AllocState(ctx context.Context, _ *pb.AllocStateRequest) (*pb.AllocStateResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	d.keys <- strings.Join(md.Get(AffinityHeader), ",")
	return &pb.AllocStateResponse{StateId: 1}, nil
}

func (d keyDrafter) ProposeStream(s pb.Drafter_ProposeStreamServer) error {
	md, _ := metadata.FromIncomingContext(s.Context())
	d.keys <- strings.Join(md.Get(AffinityHeader), ",")
	return d.echoDrafter.ProposeStream(s)
}

func TestAffinityKeyGoesWithCallsAndStreams(t *testing.T) {
	listener := bufconn.Listen(1 << 20)
	server := grpc.NewServer()
	d := keyDrafter{keys: make(chan string, 4)}
	pb.RegisterDrafterServer(server, d)
	go server.Serve(listener)
	t.Cleanup(server.Stop)
	conn, err := grpc.Dial("bufnet", grpc.WithInsecure(),
		grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) { return listener.Dial() }))
	if err != nil {
		t.Fatal(err)
	}
	c := New(conn)
	defer c.Close()
	ctx := WithAffinityKey(context.Background(), "engine-7")
	if _, err := c.AllocState(ctx); err != nil {
		t.Fatal(err)
	}
	s, err := c.OpenStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := propose(s); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if _, err := c.AllocState(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"engine-7", "engine-7", ""} {
		if got := <-d.keys; got != want {
			t.Fatalf("key %q, want %q", got, want)
		}
	}
}
