// Command mtpdraft-conformance replays the conformance vector (tests/conformance/vector.json)
// against a live server:
//
//	mtpdraft-conformance -address 127.0.0.1:50051 [-vector PATH]
//
// It prints one line per operation, then "go: N passed, M failed", and exits 1 on any failure,
// 2 on a vector it may not replay, checked before any call: a wrong format, no prob_tolerance, no
// operations, an unknown op, a ProposeStream without messages, a ProposeBatch (or a stream's
// message) without states or hiddens.
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
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/mtpdraft/mtpdraft/client/go/drafter"
	pb "github.com/mtpdraft/mtpdraft/client/go/gen/mtpdraftv1"
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

// numbers is a JSON number or a list of numbers: a Propose or AfterVerify field's one value,
// or a batch's column (B values, or one for every state).
type numbers []float64

func (n *numbers) UnmarshalJSON(b []byte) error {
	var one *float64
	if err := json.Unmarshal(b, &one); err == nil {
		*n = nil
		if one != nil {
			*n = numbers{*one}
		}
		return nil
	}
	return json.Unmarshal(b, (*[]float64)(n))
}

// scalar is the field's value (0 when absent).
func (n numbers) scalar() float64 {
	if len(n) == 0 {
		return 0
	}
	return n[0]
}

func (n numbers) int32s() []int32 {
	if n == nil {
		return nil
	}
	out := make([]int32, len(n))
	for i, v := range n {
		out[i] = int32(v)
	}
	return out
}

func (n numbers) float32s() []float32 {
	if n == nil {
		return nil
	}
	out := make([]float32, len(n))
	for i, v := range n {
		out[i] = float32(v)
	}
	return out
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
	NumDrafts     numbers                `json:"num_drafts"`
	Bitmask       *tensorJSON            `json:"bitmask"`
	MinConfidence numbers                `json:"min_confidence"`
	Previous      *verdictJSON           `json:"previous"`
	NumAccepted   numbers                `json:"num_accepted"`
	RefeedHiddens *tensorJSON            `json:"refeed_hiddens"`
	Expect        map[string]interface{} `json:"expect"`
	ExpectError   string                 `json:"expect_error"`
	ExpectReason  string                 `json:"expect_reason"`
	ExpectField   string                 `json:"expect_field"`
	Messages      []operation            `json:"messages"` // of a ProposeStream: batches
	Grammar       grammarJSON            `json:"grammar"`  // of an AllocState or a Propose
	// An AllocState's or a Propose's SamplingParams; a batch's column of them.
	Sampling        json.RawMessage `json:"sampling"`
	DraftCap        int32           `json:"draft_cap"` // of a Propose with num_drafts 0
	VerifyTokenCost float32         `json:"verify_token_cost"`

	// Of a batch, a ProposeBatch or a stream's message (with Tokens, Hiddens, NumDrafts,
	// NumAccepted, RefeedHiddens and MinConfidence as columns).
	States      []string    `json:"states"`
	Positions   []int64     `json:"positions"`
	RefeedRows  []int32     `json:"refeed_rows"`
	BitmaskRows []int32     `json:"bitmask_rows"`
	Bitmasks    *tensorJSON `json:"bitmasks"`
	// The rows whose states change sampling (Sampling their parameters), and K 0's columns.
	SamplingRows []int32 `json:"sampling_rows"`
	// The rows whose states change grammar, and those grammars.
	GrammarRows      []int32       `json:"grammar_rows"`
	Grammars         []grammarJSON `json:"grammars"`
	DraftCaps        numbers       `json:"draft_caps"`
	VerifyTokenCosts numbers       `json:"verify_token_costs"`
}

// grammarJSON is a grammar as the vector writes it: its one kind to its source, or
// {"none": true}.
type grammarJSON map[string]interface{}

// samplingJSON is a SamplingParams as the vector writes it (absent fields: 0).
type samplingJSON struct {
	Temperature float32 `json:"temperature"`
	TopK        int32   `json:"top_k"`
	TopP        float32 `json:"top_p"`
	MinP        float32 `json:"min_p"`
	Seed        uint64  `json:"seed"`
}

func (s samplingJSON) message() *pb.SamplingParams {
	return &pb.SamplingParams{Temperature: s.Temperature, TopK: s.TopK, TopP: s.TopP, MinP: s.MinP, Seed: s.Seed}
}

// sampling is an AllocState's or a Propose's SamplingParams (nil where it gives none).
func (op *operation) sampling() *pb.SamplingParams {
	if len(op.Sampling) == 0 {
		return nil
	}
	var s samplingJSON
	if err := json.Unmarshal(op.Sampling, &s); err != nil {
		panic(fmt.Sprintf("sampling: %v", err))
	}
	return s.message()
}

// samplingColumn is a batch's sampling column.
func (op *operation) samplingColumn() []*pb.SamplingParams {
	if len(op.Sampling) == 0 {
		return nil
	}
	var list []samplingJSON
	if err := json.Unmarshal(op.Sampling, &list); err != nil {
		panic(fmt.Sprintf("sampling: %v", err))
	}
	out := make([]*pb.SamplingParams, len(list))
	for i, s := range list {
		out[i] = s.message()
	}
	return out
}

// Pointers tell a missing key from a zero value.
type vector struct {
	Format        *string     `json:"format"`
	ProbTolerance *float64    `json:"prob_tolerance"`
	Operations    []operation `json:"operations"`
}

const vectorFormat = "mtpdraft-conformance/4"

var knownOps = map[string]bool{
	"GetInfo": true, "AllocState": true, "Prefill": true, "Propose": true, "ProposeBatch": true,
	"ProposeStream": true, "AfterVerify": true, "TakeKV": true, "InstallKV": true, "FreeState": true,
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
		batches := op.Messages
		if op.Op == "ProposeBatch" {
			batches = []operation{op}
		}
		for _, b := range batches {
			if len(b.States) == 0 {
				return fmt.Errorf("operation %d: a %s batch without states", i, op.Op)
			}
			if b.Hiddens == nil {
				return fmt.Errorf("operation %d: a %s batch without hiddens", i, op.Op)
			}
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

// plain is a result as encoding/json decodes the vector: numbers as float64, slices as
// []interface{} (empty, not nil, when empty), maps as map[string]interface{}. Unlike a round trip
// through JSON it keeps a NaN.
func plain(v interface{}) interface{} {
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Invalid:
		return nil
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return float64(rv.Int())
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return float64(rv.Uint())
	case reflect.Float32, reflect.Float64:
		return rv.Float()
	case reflect.Bool:
		return rv.Bool()
	case reflect.String:
		return rv.String()
	case reflect.Slice, reflect.Array:
		out := make([]interface{}, rv.Len())
		for i := range out {
			out[i] = plain(rv.Index(i).Interface())
		}
		return out
	case reflect.Map:
		out := map[string]interface{}{}
		for it := rv.MapRange(); it.Next(); {
			out[fmt.Sprint(it.Key().Interface())] = plain(it.Value().Interface())
		}
		return out
	case reflect.Ptr, reflect.Interface:
		if rv.IsNil() {
			return nil
		}
		return plain(rv.Elem().Interface())
	}
	return normalize(v)
}

// floatKeys are the fields compared within the vector's prob_tolerance, at any depth.
var floatKeys = map[string]bool{"probs": true, "confidence": true, "confidences": true, "q_probs": true}

// same says whether a result (plain) matches the vector's value of the field key: lists item by
// item, objects by the keys the vector gives, numbers of floatKeys within tol, the rest exactly.
func same(key string, want, got interface{}, tol float64) bool {
	switch w := want.(type) {
	case []interface{}:
		g, ok := got.([]interface{})
		if !ok || len(g) != len(w) {
			return false
		}
		for i := range w {
			if !same(key, w[i], g[i], tol) {
				return false
			}
		}
		return true
	case map[string]interface{}:
		g, ok := got.(map[string]interface{})
		if !ok {
			return false
		}
		for k, v := range w {
			if !same(k, v, g[k], tol) {
				return false
			}
		}
		return true
	case float64:
		g, ok := got.(float64)
		if floatKeys[key] {
			return ok && !math.IsNaN(g) && math.Abs(g-w) <= tol
		}
		return ok && g == w
	}
	return reflect.DeepEqual(want, got)
}

// show is a value as JSON, for a message.
func show(v interface{}) string {
	j, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(j)
}

// mismatches are the fields of expected that actual does not match; with one_of (the answers a
// sampled draft may give), none where actual matches one of them.
func mismatches(expected, actual map[string]interface{}, tol float64) []string {
	if answers, ok := expected["one_of"].([]interface{}); ok {
		var first []string
		for i, answer := range answers {
			bad := mismatches(answer.(map[string]interface{}), actual, tol)
			if len(bad) == 0 {
				return nil
			}
			if i == 0 {
				first = bad
			}
		}
		return []string{fmt.Sprintf("none of %d answers: %s", len(answers), strings.Join(first, "; "))}
	}
	keys := make([]string, 0, len(expected))
	for key := range expected {
		keys = append(keys, key)
	}
	sort.Strings(keys)
	var out []string
	for _, key := range keys {
		want, got := expected[key], plain(actual[key])
		if !same(key, want, got, tol) {
			out = append(out, fmt.Sprintf("%s: expected %s, got %s", key, show(want), show(got)))
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
		grammar, err := grammarOf(op.Grammar)
		if err != nil {
			return nil, err
		}
		id, err := r.client.AllocStateWith(c, drafter.StateOptions{Sampling: op.sampling(), Grammar: grammar})
		if err == nil {
			r.states[op.State], err = nonZero(id, "AllocState")
		}
		return map[string]interface{}{}, err
	case "ProposeBatch":
		res, err := r.client.ProposeBatch(c, r.batch(op))
		return batchFields(res, err)
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
		rows, err := r.client.AfterVerify(c, state, int32(op.NumAccepted.scalar()), mustTensor(op.RefeedHiddens))
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

// proposeArgs are the inputs of a Propose operation.
func proposeArgs(op *operation) drafter.ProposeArgs {
	args := drafter.ProposeArgs{Token: op.Token, Hidden: *mustTensor(op.Hidden), Position: op.Position,
		NumDrafts: int32(op.NumDrafts.scalar()), Bitmask: mustTensor(op.Bitmask),
		MinConfidence: float32(op.MinConfidence.scalar()), Sampling: op.sampling(),
		Grammar: mustGrammar(op.Grammar), DraftCap: op.DraftCap, VerifyTokenCost: op.VerifyTokenCost}
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
		"confidence": p.Confidence, "first_position": p.FirstPosition, "q_support": p.QSupport,
		"q_ids": rowsOf(p.QIds, int(p.QSupport)), "q_probs": rowsOf(p.QProbs, int(p.QSupport))}, nil
}

// rowsOf is a flat column as rows of n values (none when n is 0).
func rowsOf[T any](flat []T, n int) [][]T {
	out := [][]T{}
	for lo := 0; n > 0 && lo+n <= len(flat); lo += n {
		out = append(out, flat[lo:lo+n])
	}
	return out
}

// batch is a batch's columns (a ProposeBatch operation's or a ProposeStream message's), its
// states' names looked up.
func (r *replayer) batch(op *operation) drafter.Batch {
	ids := make([]uint64, len(op.States))
	for i, name := range op.States {
		ids[i] = r.states[name]
	}
	b := drafter.Batch{StateIDs: ids, Tokens: op.Tokens, Positions: op.Positions,
		NumDrafts: op.NumDrafts.int32s(), NumAccepted: op.NumAccepted.int32s(),
		RefeedRows: op.RefeedRows, RefeedHiddens: mustTensor(op.RefeedHiddens),
		BitmaskRows: op.BitmaskRows, Bitmasks: mustTensor(op.Bitmasks),
		MinConfidence: op.MinConfidence.float32s(), SamplingRows: op.SamplingRows,
		Sampling: op.samplingColumn(), GrammarRows: op.GrammarRows, DraftCaps: op.DraftCaps.int32s(),
		VerifyTokenCosts: op.VerifyTokenCosts.float32s()}
	for _, g := range op.Grammars {
		b.Grammars = append(b.Grammars, mustGrammar(g))
	}
	if h := mustTensor(op.Hiddens); h != nil {
		b.Hiddens = *h
	}
	return b
}

// batchFields are the fields of a batch's answer that the vector compares.
func batchFields(res *drafter.BatchResult, err error) (map[string]interface{}, error) {
	if err != nil {
		return nil, err
	}
	drafts := make([][]int32, res.Len())
	probs := make([][]float32, res.Len())
	for i := range drafts {
		drafts[i] = res.Drafts[i*res.Width : (i+1)*res.Width]
		probs[i] = res.Probs[i*res.Width : (i+1)*res.Width]
	}
	rows := make([]int, 0, len(res.Errors))
	for row := range res.Errors {
		rows = append(rows, row)
	}
	sort.Ints(rows)
	errs := make([]interface{}, len(rows))
	for i, row := range rows {
		errs[i] = rowError(row, res.Errors[row])
	}
	qIDs, qProbs := rowsOf(rowsOf(res.QIDs, res.QSupport), res.Width), rowsOf(rowsOf(res.QProbs, res.QSupport), res.Width)
	return map[string]interface{}{"width": res.Width, "drafts": drafts, "probs": probs,
		"draft_counts": res.Counts, "confidences": res.Confidences,
		"first_positions": res.FirstPositions, "errors": errs,
		"q_support": res.QSupport, "q_ids": qIDs, "q_probs": qProbs}, nil
}

// rowError is a failed row as the vector writes it.
func rowError(row int, err error) map[string]interface{} {
	reason, field := drafter.ErrorDetails(err)
	return map[string]interface{}{"row": float64(row), "code": codeNames[status.Code(err)],
		"reason": reason, "field": field}
}

// batchExpect is a batch's expect with its errors spelled out: no errors when it lists none,
// and "" for a row error's absent reason or field.
func batchExpect(expect map[string]interface{}) map[string]interface{} {
	if answers, ok := expect["one_of"].([]interface{}); ok {
		spelled := make([]interface{}, len(answers))
		for i, answer := range answers {
			spelled[i] = batchExpect(answer.(map[string]interface{}))
		}
		return map[string]interface{}{"one_of": spelled}
	}
	out := map[string]interface{}{"errors": []interface{}{}}
	for key, value := range expect {
		out[key] = value
	}
	if list, ok := out["errors"].([]interface{}); ok {
		errs := make([]interface{}, len(list))
		for i, e := range list {
			errs[i] = e
			if m, ok := e.(map[string]interface{}); ok {
				full := map[string]interface{}{"reason": "", "field": ""}
				for key, value := range m {
					full[key] = value
				}
				errs[i] = full
			}
		}
		out["errors"] = errs
	}
	return out
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
		actual, err := batchFields(stream.Step(c, r.batch(m)))
		ok, msg := judge(spelled(m), actual, err, r.tol)
		allOK = allOK && ok
		lines[i] = fmt.Sprintf("[%d] %s", i, msg)
	}
	if err := stream.Close(); err != nil {
		allOK = false
		lines = append(lines, "closing: "+err.Error())
	}
	return allOK, strings.Join(lines, "; ")
}

// spelled is a batch with its expect's errors spelled out (batchExpect); other operations as
// they are.
func spelled(op *operation) *operation {
	if op.States == nil || op.ExpectError != "" {
		return op
	}
	out := *op
	out.Expect = batchExpect(op.Expect)
	return &out
}

func (r *replayer) step(op *operation) (bool, string) {
	if op.Op == "ProposeStream" {
		return r.streamStep(op)
	}
	actual, err := r.call(op)
	return judge(spelled(op), actual, err, r.tol)
}

// judge compares a call's result, or its error, with what the operation expects.
func judge(op *operation, actual map[string]interface{}, err error, tol float64) (bool, string) {
	if err != nil {
		st, isStatus := status.FromError(err)
		if !isStatus {
			return false, "error: " + err.Error()
		}
		reason, field := drafter.ErrorDetails(err)
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
		return false, fmt.Sprintf("expected %s, got %s", op.ExpectError, show(plain(actual)))
	}
	if bad := mismatches(op.Expect, actual, tol); len(bad) > 0 {
		return false, strings.Join(bad, "; ")
	}
	return true, show(plain(actual))
}

// errorText is an error as every runner prints it: "CODE (reason R, field F)".
func errorText(code, reason, field string) string {
	return fmt.Sprintf("%s (reason %s, field %s)", code, reason, field)
}

// codeNames are the canonical status code names, as the vector writes them.
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
		switch op.Op {
		case "ProposeStream":
			label += fmt.Sprintf(" (%d messages)", len(op.Messages))
		case "ProposeBatch":
			label += " " + strings.Join(op.States, ",")
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

// mustGrammar is grammarOf's grammar; a malformed one panics, as a malformed tensor does.
func mustGrammar(kinds grammarJSON) *pb.Grammar {
	g, err := grammarOf(kinds)
	if err != nil {
		panic(fmt.Sprintf("grammar: %v", err))
	}
	return g
}

// grammarOf makes a grammar (nil: none given) from its one kind and source, or
// {"none": true}: NoGrammar.
func grammarOf(kinds grammarJSON) (*pb.Grammar, error) {
	if len(kinds) == 0 {
		return nil, nil
	}
	if len(kinds) != 1 {
		return nil, fmt.Errorf("a grammar of %d kinds, not one", len(kinds))
	}
	for kind, value := range kinds {
		if kind == "none" {
			if value != true {
				return nil, fmt.Errorf("grammar none is %v, not true", value)
			}
			return drafter.NoGrammar(), nil
		}
		source, ok := value.(string)
		if !ok {
			return nil, fmt.Errorf("grammar %s's source is not a string", kind)
		}
		switch kind {
		case "json_schema":
			return drafter.JSONSchema(source), nil
		case "ebnf":
			return drafter.EBNF(source), nil
		case "regex":
			return drafter.Regex(source), nil
		case "structural_tag":
			return drafter.StructuralTag(source), nil
		}
		return nil, fmt.Errorf("unknown grammar kind %q", kind)
	}
	return nil, nil
}
