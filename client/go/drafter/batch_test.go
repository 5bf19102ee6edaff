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

func TestBatchRequest(t *testing.T) {
	mask := Int32([]int32{-1, 3}, 2, 1)
	req := batchRequest(Batch{
		StateIDs: []uint64{7, 8}, Tokens: []int32{1, 2}, Positions: []int64{5, 9},
		Hiddens: FP32(make([]float32, 6), 2, 3), NumDrafts: []int32{3},
		NumAccepted: []int32{-1, 2}, BitmaskRows: []int32{0, 2}, Bitmasks: &mask,
		StepNumbers: []uint64{4, 4},
	})
	if !reflect.DeepEqual(req.StateIds, []uint64{7, 8}) || !reflect.DeepEqual(req.NumDrafts, []int32{3}) ||
		!reflect.DeepEqual(req.NumAccepted, []int32{-1, 2}) || !reflect.DeepEqual(req.Hiddens.Shape, []int64{2, 3}) ||
		!reflect.DeepEqual(req.StepNumbers, []uint64{4, 4}) {
		t.Fatalf("request %v", req)
	}
	if req.RefeedHiddens != nil || req.RefeedRows != nil || req.MinConfidence != nil {
		t.Fatalf("optional columns sent: %v", req)
	}
	if req.Bitmasks.Dtype != pb.DType_DTYPE_INT32 || len(req.Bitmasks.Data) != 8 {
		t.Fatalf("bitmasks %v", req.Bitmasks)
	}
	if batchRequest(Batch{}).Hiddens != nil {
		t.Fatal("a zero Hiddens is sent")
	}
}

// States given one by one make the columns: hiddens stacked, refeeds and bitmasks one after
// another with their row counts, bitmasks of fewer words padded with zero words.
func TestBatchOf(t *testing.T) {
	refeed := FP32([]float32{7, 8, 9, 10}, 2, 2)
	short, long := Int32([]int32{5}), Int32([]int32{-1, -1, 3, 4}, 2, 2)
	b, err := BatchOf([]BatchRequest{
		{3, ProposeArgs{Token: 13, Hidden: FP32([]float32{1, 2}), Position: 5, NumDrafts: 2,
			Previous: &Verdict{NumAccepted: 2, RefeedHiddens: &refeed}}},
		{1, ProposeArgs{Token: 11, Hidden: FP32([]float32{3, 4}, 1, 2), Position: 6, NumDrafts: 3,
			Bitmask: &short}},
		{8, ProposeArgs{Token: 1, Hidden: FP32([]float32{5, 6}), Position: 2, NumDrafts: 4,
			Bitmask: &long, MinConfidence: 0.5, Previous: &Verdict{NumAccepted: 1}, StepNumber: 9}},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{
		StateIDs: []uint64{3, 1, 8}, Tokens: []int32{13, 11, 1}, Positions: []int64{5, 6, 2},
		Hiddens: FP32([]float32{1, 2, 3, 4, 5, 6}, 3, 2), NumDrafts: []int32{2, 3, 4},
		NumAccepted: []int32{2, -1, 1}, RefeedRows: []int32{2, 0, 0}, RefeedHiddens: &refeed,
		BitmaskRows: []int32{0, 1, 2}, MinConfidence: []float32{0, 0, 0.5},
		StepNumbers: []uint64{0, 0, 9},
	}
	masks := Int32([]int32{5, 0, -1, -1, 3, 4}, 3, 2)
	want.Bitmasks = &masks
	if !reflect.DeepEqual(b, want) {
		t.Fatalf("batch\n%+v\nwant\n%+v", b, want)
	}
	plain, err := BatchOf([]BatchRequest{{3, ProposeArgs{Hidden: BF16([]float32{1, 2}), NumDrafts: 1}}})
	if err != nil || plain.NumAccepted != nil || plain.RefeedRows != nil || plain.BitmaskRows != nil ||
		plain.MinConfidence != nil || plain.StepNumbers != nil || !reflect.DeepEqual(plain.Hiddens.Shape, []int64{1, 2}) {
		t.Fatalf("batch of one %+v, %v", plain, err)
	}
	for _, bad := range [][]BatchRequest{
		{{1, ProposeArgs{Hidden: FP32([]float32{1, 2, 3, 4}, 2, 2)}}},                                      // two rows
		{{1, ProposeArgs{Hidden: FP32([]float32{1, 2})}}, {2, ProposeArgs{Hidden: FP32([]float32{1})}}},    // widths
		{{1, ProposeArgs{Hidden: FP32([]float32{1, 2})}}, {2, ProposeArgs{Hidden: BF16([]float32{1, 2})}}}, // dtypes
	} {
		if _, err := BatchOf(bad); err == nil {
			t.Fatalf("BatchOf(%+v) accepted", bad)
		}
	}
}

func TestBatchResult(t *testing.T) {
	resp := &pb.ProposeBatchResponse{
		Width:          3,
		Drafts:         []int32{4, 5, -1, -1, -1, -1},
		Probs:          []float32{0.5, 0.25, 0, 0, 0, 0},
		DraftCounts:    []int32{2, 0},
		Confidences:    []float32{0.25, 0},
		FirstPositions: []int64{6, 0},
		Errors: []*pb.RowError{{Row: 1, Error: &pb.Error{
			Code: int32(codes.NotFound), Message: "gone", Reason: "STATE_NOT_FOUND", Field: "state_ids"}}},
	}
	r, err := batchResult(resp, []uint64{7, 8})
	if err != nil {
		t.Fatal(err)
	}
	drafts, probs := r.Row(0)
	if r.Len() != 2 || !reflect.DeepEqual(drafts, []int32{4, 5}) || !reflect.DeepEqual(probs, []float32{0.5, 0.25}) {
		t.Fatalf("row 0: %v %v", drafts, probs)
	}
	if p, err := r.Proposal(0); err != nil || p.StateId != 7 || p.FirstPosition != 6 || p.Confidence != 0.25 {
		t.Fatalf("proposal 0: %v %v", p, err)
	}
	if drafts, _ := r.Row(1); len(drafts) != 0 {
		t.Fatalf("row 1 has drafts %v", drafts)
	}
	if r.Errors[0] != nil || status.Code(r.Errors[1]) != codes.NotFound {
		t.Fatalf("errors %v", r.Errors)
	}
	if _, err := r.Proposal(1); status.Code(err) != codes.NotFound {
		t.Fatalf("proposal 1: %v", err)
	}
	if reason, field := ErrorDetails(r.Errors[1]); reason != "STATE_NOT_FOUND" || field != "state_ids" {
		t.Fatalf("details %q %q", reason, field)
	}
	if _, err := batchResult(resp, []uint64{7}); err == nil {
		t.Fatal("an answer of two rows to a batch of one is accepted")
	}
	resp.Probs = resp.Probs[:5]
	if _, err := batchResult(resp, []uint64{7, 8}); err == nil {
		t.Fatal("a short probs column is accepted")
	}
}

// fakeDrafter answers each batch with one draft per state (its token + 1), in the reverse order
// of a pair of messages, and refuses a message without states as a whole.
type fakeDrafter struct {
	pb.UnimplementedDrafterServer
}

func (fakeDrafter) ProposeStream(s pb.Drafter_ProposeStreamServer) error {
	var held *pb.ProposeBatchRequest
	for {
		req, err := s.Recv()
		if err != nil {
			return nil
		}
		if len(req.StateIds) == 0 {
			if err := s.Send(&pb.ProposeBatchResponse{RequestId: req.RequestId, Error: &pb.Error{
				Code: int32(codes.InvalidArgument), Reason: "BATCH_SIZE_OUT_OF_RANGE", Field: "state_ids"}}); err != nil {
				return err
			}
			continue
		}
		if held == nil {
			held = req
			continue
		}
		for _, r := range []*pb.ProposeBatchRequest{req, held} {
			if err := s.Send(echo(r)); err != nil {
				return err
			}
		}
		held = nil
	}
}

func TestStreamMatchesAnswersToTheirSteps(t *testing.T) {
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
	s, err := c.OpenStream(ctx)
	if err != nil {
		t.Fatal(err)
	}

	_, err = s.Step(ctx, Batch{})
	if reason, field := ErrorDetails(err); status.Code(err) != codes.InvalidArgument ||
		reason != "BATCH_SIZE_OUT_OF_RANGE" || field != "state_ids" {
		t.Fatalf("refused step: %v", err)
	}
	results := make(chan []int32, 2)
	for _, tokens := range [][]int32{{10, 20}, {30}} {
		go func(tokens []int32) {
			b := Batch{StateIDs: make([]uint64, len(tokens)), Tokens: tokens,
				Positions: make([]int64, len(tokens))}
			r, err := s.Step(ctx, b)
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
	if _, err := s.Step(ctx, Batch{StateIDs: []uint64{1}}); status.Code(err) != codes.Unavailable {
		t.Fatalf("step after Close: %v", err)
	}
}
