package drafter

import (
	"context"
	"net"
	"reflect"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	pb "github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
)

func TestColumnsRequest(t *testing.T) {
	mask := Int32([]int32{-1, 3}, 2, 1)
	req := columnsRequest(Columns{
		StateIDs: []uint64{7, 8}, Tokens: []int32{1, 2}, Positions: []int64{5, 9},
		Hiddens: FP32(make([]float32, 6), 2, 3), NumDrafts: []int32{3},
		NumAccepted: []int32{-1, 2}, BitmaskRows: []int32{0, 2}, Bitmasks: &mask,
	})
	if !reflect.DeepEqual(req.StateIds, []uint64{7, 8}) || !reflect.DeepEqual(req.NumDrafts, []int32{3}) ||
		!reflect.DeepEqual(req.NumAccepted, []int32{-1, 2}) || !reflect.DeepEqual(req.Hiddens.Shape, []int64{2, 3}) {
		t.Fatalf("request %v", req)
	}
	if req.RefeedHiddens != nil || req.RefeedRows != nil || req.MinConfidence != nil {
		t.Fatalf("optional columns sent: %v", req)
	}
	if req.Bitmasks.Dtype != pb.DType_DTYPE_INT32 || len(req.Bitmasks.Data) != 8 {
		t.Fatalf("bitmasks %v", req.Bitmasks)
	}
	if columnsRequest(Columns{}).Hiddens != nil {
		t.Fatal("a zero Hiddens is sent")
	}
}

func TestColumnsResult(t *testing.T) {
	resp := &pb.ColumnsResponse{
		Width:          3,
		Drafts:         []int32{4, 5, -1, -1, -1, -1},
		Probs:          []float32{0.5, 0.25, 0, 0, 0, 0},
		DraftCounts:    []int32{2, 0},
		Confidences:    []float32{0.25, 0},
		FirstPositions: []int64{6, 0},
		Errors: []*pb.RowError{{Row: 1, Error: &pb.Error{
			Code: int32(codes.NotFound), Message: "gone", Reason: "STATE_NOT_FOUND", Field: "state_ids"}}},
	}
	r, err := columnsResult(resp)
	if err != nil {
		t.Fatal(err)
	}
	drafts, probs := r.Row(0)
	if r.Len() != 2 || !reflect.DeepEqual(drafts, []int32{4, 5}) || !reflect.DeepEqual(probs, []float32{0.5, 0.25}) {
		t.Fatalf("row 0: %v %v", drafts, probs)
	}
	if drafts, _ := r.Row(1); len(drafts) != 0 {
		t.Fatalf("row 1 has drafts %v", drafts)
	}
	if r.Errors[0] != nil || status.Code(r.Errors[1]) != codes.NotFound {
		t.Fatalf("errors %v", r.Errors)
	}
	if reason, field := ErrorDetails(r.Errors[1]); reason != "STATE_NOT_FOUND" || field != "state_ids" {
		t.Fatalf("details %q %q", reason, field)
	}
	resp.Probs = resp.Probs[:5]
	if _, err := columnsResult(resp); err == nil {
		t.Fatal("a short probs column is accepted")
	}
}

// fakeDrafter answers each ColumnsRequest with one draft per state (its token + 1), in the
// reverse order of a pair of requests, and refuses a request without states.
type fakeDrafter struct {
	pb.UnimplementedDrafterServer
}

func (fakeDrafter) ProposeColumnsStream(s pb.Drafter_ProposeColumnsStreamServer) error {
	var held *pb.ColumnsRequest
	for {
		req, err := s.Recv()
		if err != nil {
			return nil
		}
		if len(req.StateIds) == 0 {
			if err := s.Send(&pb.ColumnsResponse{RequestId: req.RequestId, Error: &pb.Error{
				Code: int32(codes.InvalidArgument), Reason: "COLUMNS_MISMATCH", Field: "state_ids"}}); err != nil {
				return err
			}
			continue
		}
		if held == nil {
			held = req
			continue
		}
		for _, r := range []*pb.ColumnsRequest{req, held} {
			resp := &pb.ColumnsResponse{RequestId: r.RequestId, Width: 1}
			for _, token := range r.Tokens {
				resp.Drafts = append(resp.Drafts, token+1)
				resp.Probs = append(resp.Probs, 1)
				resp.DraftCounts = append(resp.DraftCounts, 1)
				resp.Confidences = append(resp.Confidences, 1)
				resp.FirstPositions = append(resp.FirstPositions, 0)
			}
			if err := s.Send(resp); err != nil {
				return err
			}
		}
		held = nil
	}
}

func TestColumnsStream(t *testing.T) {
	listener := bufconn.Listen(1 << 20)
	server := grpc.NewServer()
	pb.RegisterDrafterServer(server, fakeDrafter{})
	go server.Serve(listener)
	defer server.Stop()
	conn, err := grpc.Dial("bufnet", grpc.WithInsecure(),
		grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) { return listener.Dial() }))
	if err != nil {
		t.Fatal(err)
	}
	c := New(conn)
	defer c.Close()
	ctx := context.Background()
	s, err := c.ProposeColumnsStream(ctx)
	if err != nil {
		t.Fatal(err)
	}

	_, err = s.Step(ctx, Columns{})
	if reason, field := ErrorDetails(err); status.Code(err) != codes.InvalidArgument ||
		reason != "COLUMNS_MISMATCH" || field != "state_ids" {
		t.Fatalf("refused step: %v", err)
	}
	results := make(chan []int32, 2)
	for _, tokens := range [][]int32{{10, 20}, {30}} {
		go func(tokens []int32) {
			r, err := s.Step(ctx, Columns{StateIDs: make([]uint64, len(tokens)), Tokens: tokens})
			if err != nil {
				t.Error(err)
				results <- nil
				return
			}
			results <- append([]int32{tokens[0]}, r.Drafts...)
		}(tokens)
	}
	got := map[int32][]int32{}
	for i := 0; i < 2; i++ {
		r := <-results
		if r != nil {
			got[r[0]] = r[1:]
		}
	}
	if !reflect.DeepEqual(got, map[int32][]int32{10: {11, 21}, 30: {31}}) {
		t.Fatalf("answers %v", got)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Step(ctx, Columns{StateIDs: []uint64{1}}); status.Code(err) != codes.Unavailable {
		t.Fatalf("step after Close: %v", err)
	}
}
