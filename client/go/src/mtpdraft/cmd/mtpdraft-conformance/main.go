// Command mtpdraft-conformance replays the conformance vector (tests/conformance/vector.json)
// against a live server:
//
//	mtpdraft-conformance -address 127.0.0.1:50051 [-vector PATH]
//
// It prints one line per operation, then "go: N passed, M failed", and exits 1 on any failure,
// 2 on a vector no runner may replay (checked before any call).
package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"reflect"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"

	"mtpdraft/drafter"
	pb "mtpdraft/gen/mtpdraftv1"
)

type tensorJSON struct {
	DType string  `json:"dtype"`
	Shape []int64 `json:"shape"`
	Data  string  `json:"data"`
}

type verdictJSON struct {
	NumAccepted   int32       `json:"num_accepted"`
	RefeedHiddens *tensorJSON `json:"refeed_hiddens"`
}

type operation struct {
	Op            string                 `json:"op"`
	State         string                 `json:"state"`
	Handle        string                 `json:"handle"`
	StartPosition int64                  `json:"start_position"`
	Tokens        []int32                `json:"tokens"`
	ChunkRows     int                    `json:"chunk_rows"`
	Hiddens       *tensorJSON            `json:"hiddens"`
	Token         int32                  `json:"token"`
	Hidden        *tensorJSON            `json:"hidden"`
	Position      int64                  `json:"position"`
	NumDrafts     int32                  `json:"num_drafts"`
	Bitmask       *tensorJSON            `json:"bitmask"`
	MinConfidence float32                `json:"min_confidence"`
	Previous      *verdictJSON           `json:"previous"`
	NumAccepted   int32                  `json:"num_accepted"`
	RefeedHiddens *tensorJSON            `json:"refeed_hiddens"`
	Expect        map[string]interface{} `json:"expect"`
	ExpectError   string                 `json:"expect_error"`
	ExpectReason  string                 `json:"expect_reason"`
	ExpectField   string                 `json:"expect_field"`
	Messages      []operation            `json:"messages"` // of a ProposeStream
}

// Pointers tell a missing key from a zero value.
type vector struct {
	Format        *string     `json:"format"`
	ProbTolerance *float64    `json:"prob_tolerance"`
	Operations    []operation `json:"operations"`
}

const vectorFormat = "mtpdraft-conformance/1"

var knownOps = map[string]bool{
	"GetInfo": true, "AllocState": true, "Prefill": true, "Propose": true, "ProposeStream": true,
	"AfterVerify": true, "TakeKV": true, "InstallKV": true, "FreeState": true,
}

// check says why no runner may replay the vector, or nil if one may.
func (v *vector) check() error {
	if v.Format == nil || *v.Format != vectorFormat {
		format := "missing"
		if v.Format != nil {
			format = fmt.Sprintf("%q", *v.Format)
		}
		return fmt.Errorf("format is %s, not %q", format, vectorFormat)
	}
	if v.ProbTolerance == nil || !(*v.ProbTolerance >= 0) || math.IsInf(*v.ProbTolerance, 1) {
		return fmt.Errorf("prob_tolerance is missing or not a non-negative number")
	}
	if len(v.Operations) == 0 {
		return fmt.Errorf("operations is missing or empty")
	}
	for i, op := range v.Operations {
		if !knownOps[op.Op] {
			return fmt.Errorf("operation %d: unknown op %q", i, op.Op)
		}
		if op.Op == "ProposeStream" && len(op.Messages) == 0 {
			return fmt.Errorf("operation %d: ProposeStream without messages", i)
		}
	}
	return nil
}

func tensor(t *tensorJSON) (*drafter.Tensor, error) {
	if t == nil {
		return nil, nil
	}
	dtype, ok := pb.DType_value[t.DType]
	if !ok {
		return nil, fmt.Errorf("unknown dtype %q", t.DType)
	}
	data, err := base64.StdEncoding.DecodeString(t.Data)
	if err != nil {
		return nil, err
	}
	return &drafter.Tensor{DType: pb.DType(dtype), Shape: t.Shape, Data: data}, nil
}

func mustTensor(t *tensorJSON) *drafter.Tensor {
	out, err := tensor(t)
	if err != nil {
		panic(err)
	}
	return out
}

// normalize gives a value the shape encoding/json decodes it to, so that it compares with the vector.
func normalize(v interface{}) interface{} {
	raw, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	var out interface{}
	if err := json.Unmarshal(raw, &out); err != nil {
		panic(err)
	}
	return out
}

func floats(v interface{}) []float64 {
	switch x := v.(type) {
	case float64:
		return []float64{x}
	case []interface{}:
		out := make([]float64, len(x))
		for i, e := range x {
			f, _ := e.(float64)
			out[i] = f
		}
		return out
	}
	return nil
}

func mismatches(expected, actual map[string]interface{}, tol float64) []string {
	var out []string
	for key, want := range expected {
		got := normalize(actual[key])
		same := false
		if key == "probs" || key == "confidence" {
			w, g := floats(want), floats(got)
			same = len(w) == len(g)
			for i := range w {
				same = same && !math.IsNaN(g[i]) && math.Abs(g[i]-w[i]) <= tol
			}
		} else {
			same = reflect.DeepEqual(want, got)
		}
		if !same {
			wj, _ := json.Marshal(want)
			gj, _ := json.Marshal(got)
			out = append(out, fmt.Sprintf("%s: expected %s, got %s", key, wj, gj))
		}
	}
	return out
}

// infoField reads a GetInfoResponse field by its proto name; enums by their names.
func infoField(info *pb.GetInfoResponse, name string) interface{} {
	m := info.ProtoReflect()
	fd := m.Descriptor().Fields().ByName(protoreflect.Name(name))
	if fd == nil {
		return nil
	}
	enumName := func(v protoreflect.Value) string {
		return string(fd.Enum().Values().ByNumber(v.Enum()).Name())
	}
	v := m.Get(fd)
	if fd.IsList() {
		list := v.List()
		out := make([]interface{}, list.Len())
		for i := range out {
			if fd.Kind() == protoreflect.EnumKind {
				out[i] = enumName(list.Get(i))
			} else {
				out[i] = list.Get(i).Interface()
			}
		}
		return out
	}
	if fd.Kind() == protoreflect.EnumKind {
		return enumName(v)
	}
	return v.Interface()
}

type replayer struct {
	client  *drafter.Client
	tol     float64
	states  map[string]uint64
	handles map[string]uint64
}

func ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 30*time.Second)
}

func nonZero(id uint64, what string) (uint64, error) {
	if id == 0 {
		return 0, fmt.Errorf("%s returned id 0", what)
	}
	return id, nil
}

func (r *replayer) call(op *operation) (map[string]interface{}, error) {
	c, cancel := ctx()
	defer cancel()
	switch op.Op {
	case "GetInfo":
		info, err := r.client.GetInfo(c)
		if err != nil {
			return nil, err
		}
		out := map[string]interface{}{}
		for key := range op.Expect {
			out[key] = infoField(info, key)
		}
		return out, nil
	case "AllocState":
		id, err := r.client.AllocState(c)
		if err == nil {
			r.states[op.State], err = nonZero(id, "AllocState")
		}
		return map[string]interface{}{}, err
	}
	state := r.states[op.State]
	switch op.Op {
	case "Prefill":
		res, err := r.client.Prefill(c, state, op.StartPosition, op.Tokens, *mustTensor(op.Hiddens), op.ChunkRows)
		return map[string]interface{}{"num_rows": res.NumRows, "next_position": res.NextPosition, "chunks": res.Chunks}, err
	case "Propose":
		p, err := r.client.Propose(c, state, proposeArgs(op))
		return proposalFields(p, err, state)
	case "AfterVerify":
		rows, err := r.client.AfterVerify(c, state, op.NumAccepted, mustTensor(op.RefeedHiddens))
		return map[string]interface{}{"num_rows": rows.NumRows, "next_position": rows.NextPosition}, err
	case "TakeKV":
		h, err := r.client.TakeKV(c, state)
		if err != nil {
			return nil, err
		}
		r.handles[op.Handle], err = nonZero(h.HandleId, "TakeKV")
		return map[string]interface{}{"num_rows": h.NumRows}, err
	case "InstallKV":
		rows, err := r.client.InstallKV(c, state, r.handles[op.Handle])
		return map[string]interface{}{"num_rows": rows.NumRows, "next_position": rows.NextPosition}, err
	case "FreeState":
		existed, err := r.client.FreeState(c, state)
		return map[string]interface{}{"existed": existed}, err
	}
	return nil, fmt.Errorf("unknown operation %q", op.Op)
}

// proposeArgs are the Propose inputs of an operation (or of a ProposeStream message).
func proposeArgs(op *operation) drafter.ProposeArgs {
	args := drafter.ProposeArgs{Token: op.Token, Hidden: *mustTensor(op.Hidden), Position: op.Position,
		NumDrafts: op.NumDrafts, Bitmask: mustTensor(op.Bitmask), MinConfidence: op.MinConfidence}
	if op.Previous != nil {
		args.Previous = &drafter.Verdict{NumAccepted: op.Previous.NumAccepted,
			RefeedHiddens: mustTensor(op.Previous.RefeedHiddens)}
	}
	return args
}

// proposalFields are the fields of a Propose result that the vector compares.
func proposalFields(p *pb.Proposal, err error, state uint64) (map[string]interface{}, error) {
	if err != nil {
		return nil, err
	}
	if p.StateId != state {
		return nil, fmt.Errorf("Proposal.state_id %d != state %d", p.StateId, state)
	}
	return map[string]interface{}{"tokens": p.Tokens, "probs": p.Probs,
		"confidence": p.Confidence, "first_position": p.FirstPosition}, nil
}

// streamStep sends a ProposeStream's messages on one stream, each answered before the next.
func (r *replayer) streamStep(op *operation) (bool, string) {
	c, cancel := ctx()
	defer cancel()
	stream, err := r.client.OpenStream(c)
	if err != nil {
		return false, "error: " + err.Error()
	}
	allOK, lines := true, make([]string, len(op.Messages))
	for i := range op.Messages {
		m := &op.Messages[i]
		state := r.states[m.State]
		p, err := stream.Propose(c, state, proposeArgs(m))
		actual, err := proposalFields(p, err, state)
		ok, msg := judge(m, actual, err, r.tol)
		allOK = allOK && ok
		lines[i] = fmt.Sprintf("[%d] %s", i, msg)
	}
	if err := stream.Close(); err != nil {
		allOK = false
		lines = append(lines, "closing: "+err.Error())
	}
	return allOK, strings.Join(lines, "; ")
}

func (r *replayer) step(op *operation) (bool, string) {
	if op.Op == "ProposeStream" {
		return r.streamStep(op)
	}
	actual, err := r.call(op)
	return judge(op, actual, err, r.tol)
}

// judge compares a call's result, or its error, with what the operation expects.
func judge(op *operation, actual map[string]interface{}, err error, tol float64) (bool, string) {
	if err != nil {
		st, isStatus := status.FromError(err)
		if !isStatus {
			return false, "error: " + err.Error()
		}
		reason, field := errorDetails(st)
		got := errorText(codeNames[st.Code()], reason, field)
		want := "success"
		if op.ExpectError != "" {
			want = errorText(op.ExpectError, op.ExpectReason, op.ExpectField)
		}
		if got == want {
			return true, got + " as expected"
		}
		return false, fmt.Sprintf("expected %s, got %s: %s", want, got, st.Message())
	}
	if op.ExpectError != "" {
		j, _ := json.Marshal(actual)
		return false, fmt.Sprintf("expected %s, got %s", op.ExpectError, j)
	}
	if bad := mismatches(op.Expect, actual, tol); len(bad) > 0 {
		return false, strings.Join(bad, "; ")
	}
	j, _ := json.Marshal(actual)
	return true, string(j)
}

// codeNames are the canonical status code names, as the vector writes them.
// errorText is an error as every runner prints it: "CODE (reason R, field F)".
func errorText(code, reason, field string) string {
	return fmt.Sprintf("%s (reason %s, field %s)", code, reason, field)
}

// errorDetails is the status's ErrorInfo reason and its first BadRequest field, if any.
func errorDetails(st *status.Status) (reason, field string) {
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			reason = d.Reason
		case *errdetails.BadRequest:
			if len(d.FieldViolations) > 0 {
				field = d.FieldViolations[0].Field
			}
		}
	}
	return reason, field
}

var codeNames = map[codes.Code]string{
	codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
	codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
	codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
	codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED",
	codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED",
	codes.Internal: "INTERNAL", codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS",
	codes.Unauthenticated: "UNAUTHENTICATED",
}

func main() {
	address := flag.String("address", os.Getenv("MTPDRAFT_CONFORMANCE_ADDRESS"), "server host:port")
	path := flag.String("vector", "tests/conformance/vector.json", "the conformance vector")
	flag.Parse()
	if *address == "" {
		fmt.Fprintln(os.Stderr, "usage: mtpdraft-conformance -address HOST:PORT [-vector PATH]")
		os.Exit(2)
	}
	raw, err := os.ReadFile(*path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "go:", err)
		os.Exit(2)
	}
	var v vector
	err = json.Unmarshal(raw, &v)
	if err == nil {
		err = v.check()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "go: bad vector:", err)
		os.Exit(2)
	}
	client, err := drafter.Dial(*address)
	if err != nil {
		fmt.Fprintln(os.Stderr, "go:", err)
		os.Exit(2)
	}
	defer client.Close()
	r := &replayer{client: client, tol: *v.ProbTolerance, states: map[string]uint64{}, handles: map[string]uint64{}}
	passed, failed := 0, 0
	for i := range v.Operations {
		op := &v.Operations[i]
		ok, msg := r.step(op)
		mark := "ok  "
		if ok {
			passed++
		} else {
			failed++
			mark = "FAIL"
		}
		label := op.Op
		if op.State != "" {
			label += " " + op.State
		}
		if op.Op == "ProposeStream" {
			label += fmt.Sprintf(" (%d messages)", len(op.Messages))
		}
		fmt.Printf("%s %02d %s: %s\n", mark, i, label, msg)
	}
	for _, state := range r.states { // leave nothing behind, even after a failure
		c, cancel := ctx()
		_, _ = client.FreeState(c, state)
		cancel()
	}
	fmt.Printf("go: %d passed, %d failed\n", passed, failed)
	if failed > 0 || passed != len(v.Operations) {
		os.Exit(1)
	}
}
