// C++ client of the mtpdraft.v1.Drafter gRPC service (protos/mtpdraft/v1/drafter.proto).
//
//   mtpdraft::DrafterClient drafter("localhost:50051");
//   uint64_t state = drafter.AllocState();
//   drafter.Prefill(state, 1, tokens, mtpdraft::Tensor::FP32(hiddens, {n, hidden_size}));
//   mtpdraft::ProposeArgs args;
//   args.token = t, args.hidden = mtpdraft::Tensor::FP32(h), args.position = pos, args.num_drafts = 3;
//   mtpdraft::Proposal p = drafter.Propose(state, args);
//   drafter.AfterVerify(state, accepted);
//   drafter.FreeState(state);
//
// A verifier that steps many states at once sends the whole step as one batch of columns
// (ProposeBatch, or one message per step on a ProposeStream). The columns are views of the
// caller's arrays; row i of each is state_ids[i]'s (BatchOf makes them from states given one by
// one):
//   mtpdraft::Batch step;
//   step.state_ids = ids, step.tokens = tokens, step.positions = positions;  // B values each
//   step.hiddens = mtpdraft::Tensor::FP32(h, {b, hidden_size});
//   step.num_drafts = ks;       // B values, or one for every state
//   step.num_accepted = accepted;  // the verdicts on the pending proposals, -1 for none
//   mtpdraft::BatchResult r = drafter.ProposeBatch(step);  // or stream->Step(step)
//   for (size_t i = 0; i < r.size(); ++i) {
//     if (const mtpdraft::DrafterError* e = r.Error(i)) { /* row i failed, its state unchanged */ }
//     mtpdraft::ArrayView<int32_t> drafts = r.Drafts(i);  // r.counts[i] drafts
//   }
//
// The hot path is a stream, one round trip per verify step: each state's verdict on its pending
// proposal (its fused AfterVerify) rides with its next proposal. Many states and threads may
// share one stream; one state is a batch of one:
//   std::unique_ptr<mtpdraft::ProposeStream> stream = drafter.OpenStream();
//   mtpdraft::Proposal p = stream->Propose(state, args);
//   // the target accepts the first `a` of p.tokens and samples the bonus token b:
//   args.previous = mtpdraft::Verdict{a};
//   args.token = b, args.position = p.first_position + a;
//   args.hidden = mtpdraft::Tensor::FP32(h);  // the target hidden at args.position - 1
//   p = stream->Propose(state, args);
//   stream->Close();
//
// Tensors are raw little-endian bytes with a dtype and a shape. A failed RPC throws
// mtpdraft::DrafterError, whose code() is the grpc::StatusCode and reason() and field()
// say why; so does a stream message the server refuses as a whole, which leaves the stream
// open.
//
// Deadlines: the client's `timeout` bounds each unary call and each Prefill. A stream
// (OpenStream) has no deadline unless its own `timeout` asks for one.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mtpdraft/array_view.h"
#include "mtpdraft/sampling.h"
#include "mtpdraft/v1/drafter.grpc.pb.h"

namespace mtpdraft {

namespace pb = ::mtpdraft::v1;

// A dense tensor: raw little-endian bytes in row-major order, a dtype and a shape.
struct Tensor {
  pb::DType dtype = pb::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  std::string data;  // raw bytes

  static Tensor FP32(const std::vector<float>& values, std::vector<int64_t> shape = {});
  // The product(shape) floats at `values`, e.g. a [B, hidden] block of a verifier's buffer.
  static Tensor FP32(const float* values, std::vector<int64_t> shape);
  static Tensor Int32(const std::vector<int32_t>& values, std::vector<int64_t> shape = {});
  // Bytes per element of a dtype (0 if unknown).
  static int ItemSize(pb::DType dtype);
  void ToProto(pb::Tensor* out) const;
};

// A failed RPC: the gRPC status code and message, the machine-readable reason
// (google.rpc.ErrorInfo, e.g. "KV_BLOCKS_EXHAUSTED" against "QUEUE_FULL" for one
// RESOURCE_EXHAUSTED) and the request field at fault (google.rpc.BadRequest, e.g.
// "position"), each empty where the server sent none.
class DrafterError : public std::runtime_error {
 public:
  // Reads the reason and field from the status's details (grpc-status-details-bin).
  explicit DrafterError(const grpc::Status& status);
  // An error carried as a value (a failed row, a refused stream message), which holds them.
  DrafterError(const grpc::Status& status, std::string reason, std::string field);
  grpc::StatusCode code() const { return status_.error_code(); }
  const grpc::Status& status() const { return status_; }
  // The canonical name of the code, e.g. "NOT_FOUND".
  std::string code_name() const;
  const std::string& reason() const { return reason_; }
  const std::string& field() const { return field_; }

 private:
  grpc::Status status_;
  std::string reason_;
  std::string field_;
};

// The canonical name of a status code ("INVALID_ARGUMENT").
std::string StatusCodeName(grpc::StatusCode code);

// A state's size after a call: the rows it holds and the position the next row must have.
struct Rows {
  int64_t num_rows = 0;
  int64_t next_position = 0;
};

struct PrefillResult : Rows {
  int chunks = 0;  // chunks the stream carried
};

// The verdict on a pending proposal; refeed_hiddens: the target's [num_accepted, hidden].
struct Verdict {
  int32_t num_accepted = 0;
  std::optional<Tensor> refeed_hiddens;
};

struct ProposeArgs {
  int32_t token = 0;
  Tensor hidden;  // the target hidden at position - 1
  int64_t position = 0;
  int32_t num_drafts = 1;
  std::optional<Tensor> bitmask;  // xgrammar packed int32 bitmask
  float min_confidence = 0.0f;
  std::optional<Verdict> previous;  // fused AfterVerify of the pending proposal
  // The state's step number, increasing (0: not numbered): sent again while its proposal is
  // pending, the step is answered as it was and applied once, so a step whose outcome is
  // unknown (DEADLINE_EXCEEDED, UNAVAILABLE) is safe to resend.
  uint64_t step_number = 0;
  // For a state with a grammar: answer its bitmask at each draft's and the bonus position.
  bool return_bitmasks = false;
  // The state's sampling from this step on (see StateOptions).
  std::optional<pb::SamplingParams> sampling;
  // The state's grammar from this step's token on (one with set_none(true): none from this
  // step on; unset: the state keeps its own).
  std::optional<pb::Grammar> grammar;
  // With num_drafts 0 the drafter chooses K, up to draft_cap (0: GetInfo's max_drafts), for
  // the most tokens per unit of verify cost: verify_token_cost is what verifying one more
  // token costs, as a fraction of a verify step.
  int32_t draft_cap = 0;
  float verify_token_cost = 0.0f;
};

// How a new state drafts (AllocState); the default is greedy, without a grammar.
struct StateOptions {
  // Draws each draft from q, the head's distribution after vLLM's temperature, min_p, top_k
  // and top_p, cut to GetInfo's max_sample_top_k tokens; the answers then carry q, which
  // Accept and AcceptBatch take. A draw depends only on (seed, state, position, draft index).
  std::optional<pb::SamplingParams> sampling;
  std::optional<pb::Grammar> grammar;  // what every draft obeys
};

struct Proposal {
  uint64_t state_id = 0;
  std::vector<int32_t> tokens;
  std::vector<float> probs;
  float confidence = 0.0f;
  int64_t first_position = 0;
  // Asked with return_bitmasks, for a state with a grammar: [tokens + 1, bitmask_words]
  // int32 row-major, row j the grammar's bitmask at first_position + j; empty otherwise.
  std::vector<int32_t> bitmasks;
  // Sampled drafts: each draft's q, [tokens, q_support] row-major ids (most probable first)
  // and probabilities (probs[j] is q(tokens[j])); q_support 0 and empty otherwise.
  int32_t q_support = 0;
  std::vector<int32_t> q_ids;
  std::vector<float> q_probs;
};

// A verifier's step for B states as columns (ProposeBatchRequest): row i of every column is
// state_ids[i]'s. The views are read during the call only. The server checks that the
// columns fit together: lengths or shapes that do not fail the whole call with
// INVALID_ARGUMENT (reason COLUMNS_MISMATCH or BAD_SHAPE, field the column).
struct Batch {
  ArrayView<uint64_t> state_ids;
  ArrayView<int32_t> tokens;     // B values: each state's last token (sampled or prefilled)
  ArrayView<int64_t> positions;  // B values: each last token's position
  Tensor hiddens;                // [B, hidden_size]: each state's target hidden at position - 1
  ArrayView<int32_t> num_drafts;    // K: B values, or one for every state
  ArrayView<int32_t> num_accepted;  // verdicts on the pending proposals: B values, -1 for
                                    // none; empty: no verdicts
  ArrayView<int32_t> refeed_rows;   // B counts of refeed_hiddens rows, each 0 or the state's
                                    // num_accepted; empty: no refeed
  std::optional<Tensor> refeed_hiddens;  // [sum(refeed_rows), hidden_size], state by state
  ArrayView<int32_t> bitmask_rows;  // B counts of bitmasks rows, each 0 (no mask) or 1 .. K
  std::optional<Tensor> bitmasks;   // [sum(bitmask_rows), bitmask_words] int32, state by state
  ArrayView<float> min_confidence;  // B values, one for every state, or empty (draft all K)
  ArrayView<uint64_t> step_numbers;  // B step numbers (ProposeArgs::step_number), one for
                                     // every state, or empty (not numbered)
  bool return_bitmasks = false;     // answer each grammar state's bitmasks
  // The rows (ascending, each once) whose states take new sampling from this step on, and
  // their parameters, one per row listed; empty: no change.
  ArrayView<int32_t> sampling_rows;
  ArrayView<pb::SamplingParams> sampling;
  // The rows (ascending, each once) whose states take a grammar (or none) from this step on,
  // and those grammars, one per row listed; a grammar the server refuses fails its row alone
  // (field grammars). Empty: no change.
  ArrayView<int32_t> grammar_rows;
  ArrayView<pb::Grammar> grammars;
  // For rows with num_drafts 0 (the drafter chooses K), ProposeArgs' draft_cap and
  // verify_token_cost: B values, one for every state, or empty (0).
  ArrayView<int32_t> draft_caps;
  ArrayView<float> verify_token_costs;
};

// One state of a batch given state by state (BatchOf): the state and its Propose.
struct BatchRequest {
  uint64_t state = 0;
  ProposeArgs args;
};

// A Batch of states given one by one, owning its columns (BatchOf); batch() views them.
struct StatesBatch {
  std::vector<uint64_t> state_ids;
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;
  Tensor hiddens;
  std::vector<int32_t> num_drafts;
  std::vector<int32_t> num_accepted;
  std::vector<int32_t> refeed_rows;
  std::optional<Tensor> refeed_hiddens;
  std::vector<int32_t> bitmask_rows;
  std::optional<Tensor> bitmasks;
  std::vector<float> min_confidence;
  std::vector<uint64_t> step_numbers;
  std::vector<int32_t> sampling_rows;
  std::vector<pb::SamplingParams> sampling;
  std::vector<int32_t> grammar_rows;
  std::vector<pb::Grammar> grammars;
  std::vector<int32_t> draft_caps;
  std::vector<float> verify_token_costs;

  // A view of the columns, valid while this StatesBatch lives unchanged.
  Batch batch() const;
};

// The batch of states given one by one: row i is requests[i]'s. Their hiddens (each [hidden]
// or [1, hidden]) are stacked, their refeeds and bitmasks put one after another with each one's
// row count; bitmasks of fewer words are padded with zero words (which allow no token, as the
// server reads them). Throws std::invalid_argument unless the hiddens, and the refeeds, share
// one dtype and width.
StatesBatch BatchOf(const std::vector<BatchRequest>& requests);

// The answer to a Batch, as columns: row i is state_ids[i]'s. A row that failed has count 0
// and its error in `errors`; its state is unchanged.
struct BatchResult {
  std::vector<uint64_t> state_ids;  // the batch's
  int32_t width = 0;              // the largest K asked: the columns of drafts and probs
  std::vector<int32_t> drafts;    // [B, width] row-major: row i's counts[i] drafts, then -1
  std::vector<float> probs;       // [B, width]: each draft's top-1 probability, then 0
  std::vector<int32_t> counts;    // B values: drafts in each row
  std::vector<float> confidences;        // B values: each row's chain confidence
  std::vector<int64_t> first_positions;  // B values: the position of each row's first draft
  std::map<int32_t, DrafterError> errors;  // the failed rows' errors, by row
  // With return_bitmasks: each row's rows of bitmasks (counts[i] + 1 for a grammar state,
  // else 0), and those rows, [sum(bitmask_rows), bitmask_words] int32 row-major.
  std::vector<int32_t> bitmask_rows;
  std::vector<int32_t> bitmasks;
  // When some row was sampled: each draft's q, [B, width, q_support] row-major ids and
  // probabilities (a greedy row's q is its draft alone at 1; past a row's count, 0);
  // q_support 0 and empty when no row was.
  int32_t q_support = 0;
  std::vector<int32_t> q_ids;
  std::vector<float> q_probs;

  // B, the number of rows.
  size_t size() const { return counts.size(); }
  // Row i's drafts (counts[i] of them) and their probabilities.
  ArrayView<int32_t> Drafts(size_t row) const {
    return {drafts.data() + row * width, static_cast<size_t>(counts[row])};
  }
  ArrayView<float> Probs(size_t row) const {
    return {probs.data() + row * width, static_cast<size_t>(counts[row])};
  }
  // Row i's error, or nullptr when it was answered.
  const DrafterError* Error(size_t row) const {
    auto it = errors.find(static_cast<int32_t>(row));
    return it == errors.end() ? nullptr : &it->second;
  }
  // Row i as a Proposal; throws its DrafterError if it failed.
  Proposal RowProposal(size_t row) const;
};

// Accept over a batch's answer as it is: each row's width drafts, their q (the answer's;
// where no row was sampled, each draft alone at 1) and counts. target_probs [B, width + 1,
// vocab] and uniforms [B, width + 1] as AcceptArgs'. A failed row counts no drafts: its next
// token is drawn from the target's distribution at its first position.
Accepted AcceptBatch(const BatchResult& r, ArrayView<double> target_probs, size_t vocab,
                     ArrayView<double> uniforms);

struct KVHandle {
  uint64_t handle_id = 0;
  int64_t num_rows = 0;
  double ttl_seconds = 0.0;
};

namespace internal {

// One ProposeStream call whose answers are matched to their batches by request_id.
class StreamCall {
 public:
  using Call = grpc::ClientReaderWriter<pb::ProposeBatchRequest, pb::ProposeBatchResponse>;

  StreamCall(pb::Drafter::Stub& stub, std::chrono::milliseconds timeout,
             const std::string& affinity_key);
  ~StreamCall();  // Close()
  StreamCall(const StreamCall&) = delete;
  StreamCall& operator=(const StreamCall&) = delete;

  // Sends `req` with the next request_id.
  std::future<BatchResult> Submit(pb::ProposeBatchRequest req);
  grpc::Status Close();
  void Cancel();

 private:
  // A batch awaiting its answer: the promise of its result, and the states it named.
  struct Pending {
    std::promise<BatchResult> promise;
    std::vector<uint64_t> state_ids;
  };

  void Read();
  // What a request fails with once the stream has ended.
  grpc::Status Failure();

  grpc::ClientContext context_;
  std::unique_ptr<Call> call_;
  std::mutex write_mu_;  // one write (or WritesDone, or Finish) at a time on the call
  bool writable_ = true;  // guarded by write_mu_: false after WritesDone or Finish
  std::mutex mu_;         // guards the fields below; taken after write_mu_, never before
  uint64_t next_id_ = 1;
  std::map<uint64_t, Pending> pending_;
  grpc::Status failure_;  // what Failure() returns
  grpc::Status status_;   // the call's final status, once the reader has finished it
  std::mutex close_mu_;  // one Close() joins the reader
  std::thread reader_;
};

}  // namespace internal

// One ProposeStream call: one message per verifier step, each a Batch for many states (a single
// state is a batch of one), answered by one BatchResult matched by request_id. Steps may be in
// flight at once from any threads; answers come as their batches are drafted, possibly out of
// order, and two naming one state are served in the order sent. A row that fails has its error
// in the result's `errors`; a step that fails as a whole (its columns do not fit together)
// throws its DrafterError and leaves the stream open; when the call itself ends (server gone,
// deadline, Cancel) every step in flight fails with its status, and so do later ones.
class ProposeStream {
 public:
  ~ProposeStream() = default;  // Close()
  ProposeStream(const ProposeStream&) = delete;
  ProposeStream& operator=(const ProposeStream&) = delete;

  // Sends one step; its future throws DrafterError when the step failed as a whole. Throws
  // DrafterError itself once the stream has ended or is closing.
  std::future<BatchResult> Submit(const Batch& step);
  // One verifier step's round trip: Submit(step).get().
  BatchResult Step(const Batch& step);
  // One state's round trip, a batch of one; throws its DrafterError if it failed.
  Proposal Propose(uint64_t state, const ProposeArgs& args);
  // Ends the stream once the answers in flight have arrived; the call's final status.
  // Idempotent.
  grpc::Status Close() { return call_.Close(); }
  // Ends the call now: steps in flight fail with CANCELLED. Close() still joins.
  void Cancel() { call_.Cancel(); }

 private:
  friend class DrafterClient;
  ProposeStream(pb::Drafter::Stub& stub, std::chrono::milliseconds timeout,
                const std::string& affinity_key)
      : call_(stub, timeout, affinity_key) {}

  internal::StreamCall call_;
};

class DrafterClient {
 public:
  // An insecure channel to `address` ("host:port"); `timeout` is the deadline of every unary
  // call and Prefill (zero: none), never of a stream (see OpenStream).
  explicit DrafterClient(const std::string& address,
                         std::chrono::milliseconds timeout = std::chrono::seconds(30));
  explicit DrafterClient(std::shared_ptr<grpc::Channel> channel,
                         std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // Sent with every later call (streams opened later included) as the x-mtpdraft-affinity
  // metadata, by which a proxy in front of several replicas sends all of a key's calls to one
  // of them (deploy/README.md). Empty: none.
  void SetAffinityKey(std::string key) { affinity_key_ = std::move(key); }
  const std::string& affinity_key() const { return affinity_key_; }

  pb::GetInfoResponse GetInfo();
  uint64_t AllocState();
  // A new state whose every draft obeys `grammar` (one of its kinds set: json_schema, ebnf,
  // regex or structural_tag); GetInfo().grammar_kinds() lists the kinds the server takes.
  uint64_t AllocState(const pb::Grammar& grammar);
  // A new state that drafts as `options` says (sampling, grammar).
  uint64_t AllocState(const StateOptions& options);
  // Appends rows (tokens[i], hiddens row i) at start_position + i, streamed in chunks of
  // chunk_rows rows (0: as many as fit in 4 MiB). All or nothing.
  PrefillResult Prefill(uint64_t state, int64_t start_position, const std::vector<int32_t>& tokens,
                        const Tensor& hiddens, int chunk_rows = 0);
  Proposal Propose(uint64_t state, const ProposeArgs& args);
  // A verifier's whole step for B states in one message, as columns (at most
  // GetInfo.max_batch rows, each state at most once). A row that fails has its error in
  // the result's `errors` and leaves its state unchanged; columns that do not fit together
  // fail the call.
  BatchResult ProposeBatch(const Batch& step);
  // The hot path: a ProposeStream, one Batch a message. `timeout` is the whole stream's
  // deadline; zero (the default) sets none, since a stream lives as long as its verifier, not
  // one call (the client's own timeout is not applied).
  std::unique_ptr<ProposeStream> OpenStream(
      std::chrono::milliseconds timeout = std::chrono::milliseconds::zero());
  Rows AfterVerify(uint64_t state, int32_t num_accepted,
                   const std::optional<Tensor>& refeed_hiddens = std::nullopt);
  KVHandle TakeKV(uint64_t state);
  Rows InstallKV(uint64_t state, uint64_t handle);
  // Whether the state existed. Idempotent.
  bool FreeState(uint64_t state);

  pb::Drafter::Stub& stub() { return *stub_; }

 private:
  void Prepare(grpc::ClientContext* context) const;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Drafter::Stub> stub_;
  std::chrono::milliseconds timeout_;
  std::string affinity_key_;
};

}  // namespace mtpdraft
