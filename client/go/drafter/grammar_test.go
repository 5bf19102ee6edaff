package drafter

import (
	"context"
	"net"
	"reflect"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/test/bufconn"

	pb "github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
)

// grammarDrafter records the grammar of each AllocState.
type grammarDrafter struct {
	pb.UnimplementedDrafterServer
	grammars chan *pb.Grammar
}

func (d grammarDrafter) AllocState(_ context.Context, req *pb.AllocStateRequest) (*pb.AllocStateResponse, error) {
	d.grammars <- req.GetGrammar()
	return &pb.AllocStateResponse{StateId: 1}, nil
}

func TestAllocStateSendsItsGrammar(t *testing.T) {
	listener := bufconn.Listen(1 << 20)
	server := grpc.NewServer()
	d := grammarDrafter{grammars: make(chan *pb.Grammar, 5)}
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
	ctx := context.Background()
	if _, err := c.AllocState(ctx); err != nil {
		t.Fatal(err)
	}
	if g := <-d.grammars; g != nil {
		t.Fatalf("AllocState sent grammar %v", g)
	}
	for _, g := range []*pb.Grammar{JSONSchema(`{"type":"object"}`), EBNF(`root ::= "a"`),
		Regex("[a-z]+"), StructuralTag(`{"type":"structural_tag"}`)} {
		if _, err := c.AllocStateWithGrammar(ctx, g); err != nil {
			t.Fatal(err)
		}
		got := <-d.grammars
		if got.GetJsonSchema() != g.GetJsonSchema() || got.GetEbnf() != g.GetEbnf() ||
			got.GetRegex() != g.GetRegex() || got.GetStructuralTag() != g.GetStructuralTag() {
			t.Fatalf("sent %v, the server got %v", g, got)
		}
	}
}

// maskDrafter answers a Propose that asks for bitmasks with one row of them.
type maskDrafter struct{ pb.UnimplementedDrafterServer }

func (maskDrafter) Propose(_ context.Context, req *pb.ProposeRequest) (*pb.Proposal, error) {
	p := &pb.Proposal{StateId: req.StateId}
	if req.ReturnBitmasks {
		p.Bitmasks = &pb.Tensor{Dtype: pb.DType_DTYPE_INT32, Shape: []int64{1, 1}, Data: []byte{1, 0, 0, 0}}
	}
	return p, nil
}

func TestProposeAsksForBitmasks(t *testing.T) {
	listener := bufconn.Listen(1 << 20)
	server := grpc.NewServer()
	pb.RegisterDrafterServer(server, maskDrafter{})
	go server.Serve(listener)
	t.Cleanup(server.Stop)
	conn, err := grpc.Dial("bufnet", grpc.WithInsecure(),
		grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) { return listener.Dial() }))
	if err != nil {
		t.Fatal(err)
	}
	c := New(conn)
	defer c.Close()
	for _, ask := range []bool{false, true} {
		p, err := c.Propose(context.Background(), 3, ProposeArgs{Token: 1, Hidden: FP32([]float32{0}),
			Position: 1, NumDrafts: 1, ReturnBitmasks: ask})
		if err != nil {
			t.Fatal(err)
		}
		if (p.GetBitmasks() != nil) != ask {
			t.Fatalf("ReturnBitmasks %v: bitmasks %v", ask, p.GetBitmasks())
		}
	}
}

// A grammar given on a Propose travels in its request; given state by state in a batch, the
// rows that change grammar (ascending) with their grammars, NoGrammar among them as none.
func TestProposeAndBatchSendGrammarChanges(t *testing.T) {
	digits := Regex("[0-3]{4}")
	if p := proposeRequest(3, ProposeArgs{NumDrafts: 1, Grammar: digits}); p.GetGrammar().GetRegex() != "[0-3]{4}" {
		t.Fatalf("propose request's grammar %v", p.GetGrammar())
	}
	if p := proposeRequest(3, ProposeArgs{NumDrafts: 1, Grammar: NoGrammar()}); !p.GetGrammar().GetNone() {
		t.Fatalf("NoGrammar sent as %v", p.GetGrammar())
	}
	if p := proposeRequest(3, ProposeArgs{NumDrafts: 1}); p.Grammar != nil {
		t.Fatalf("a propose without a grammar sent %v", p.Grammar)
	}
	b, err := BatchOf([]BatchRequest{
		{3, ProposeArgs{Hidden: FP32([]float32{1}), NumDrafts: 1, Grammar: NoGrammar()}},
		{4, ProposeArgs{Hidden: FP32([]float32{2}), NumDrafts: 1}},
		{5, ProposeArgs{Hidden: FP32([]float32{3}), NumDrafts: 1, Grammar: digits}},
	})
	if err != nil {
		t.Fatal(err)
	}
	req := batchRequest(b)
	if !reflect.DeepEqual(req.GrammarRows, []int32{0, 2}) || len(req.Grammars) != 2 ||
		!req.Grammars[0].GetNone() || req.Grammars[1].GetRegex() != "[0-3]{4}" {
		t.Fatalf("grammar columns %v %v", req.GrammarRows, req.Grammars)
	}
	plain, err := BatchOf([]BatchRequest{{3, ProposeArgs{Hidden: FP32([]float32{1}), NumDrafts: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	if r := batchRequest(plain); r.GrammarRows != nil || r.Grammars != nil {
		t.Fatalf("grammar columns sent without a grammar: %v %v", r.GrammarRows, r.Grammars)
	}
}
