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
// The hot path is a stream, one round trip per verify step: each Propose carries the verdict
// on the state's pending proposal (its fused AfterVerify). Many states and threads may share
// one stream.
//   std::unique_ptr<mtpdraft::ProposeStream> stream = drafter.OpenStream();
//   mtpdraft::Proposal p = stream->Propose(state, args);
//   // the target accepts the first `a` of p.tokens and samples the bonus token b:
//   args.previous = mtpdraft::Verdict{a};
//   args.token = b, args.position = p.first_position + a;
//   args.hidden = mtpdraft::Tensor::FP32(h);  // the target hidden at args.position - 1
//   p = stream->Propose(state, args);
//   stream->Close();
//
// A verifier that steps many states at once sends the whole step as columns, one message
// (ProposeColumns, or one message per step on a ColumnsStream). The columns are views of the
// caller's arrays; row i of each is state_ids[i]'s:
//   mtpdraft::Columns step;
//   step.state_ids = ids, step.tokens = tokens, step.positions = positions;  // B values each
//   step.hiddens = mtpdraft::Tensor::FP32(h, {b, hidden_size});
//   step.num_drafts = ks;       // B values, or one for every state
//   step.num_accepted = accepted;  // the verdicts on the pending proposals, -1 for none
//   mtpdraft::ColumnsResult r = drafter.ProposeColumns(step);  // or columns_stream->Step(step)
//   for (size_t i = 0; i < r.size(); ++i) {
//     if (const mtpdraft::DrafterError* e = r.Error(i)) { /* row i failed, its state unchanged */ }
//     mtpdraft::ArrayView<int32_t> drafts = r.Drafts(i);  // r.counts[i] drafts
//   }
//
// Tensors are raw little-endian bytes with a dtype and a shape. A failed RPC throws
// mtpdraft::DrafterError, whose code() is the grpc::StatusCode and reason() and field()
// say why; so does a stream's error answer, which leaves the stream open.
//
// Deadlines: the client's `timeout` bounds each unary call and each Prefill. A stream
// (OpenStream, OpenColumnsStream) has no deadline unless its own `timeout` asks for one.
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

#include "mtpdraft/v1/drafter.grpc.pb.h"

namespace mtpdraft {

namespace pb = ::mtpdraft::v1;

// A read-only view of `size` contiguous values the caller owns, such as one column of a
// verifier's step: it must outlive the call it is passed to. Made from a std::vector (not a
// temporary one) or a pointer and a count; empty by default.
template <typename T>
class ArrayView {
 public:
  ArrayView() = default;
  ArrayView(const T* data, size_t size) : data_(data), size_(size) {}
  ArrayView(const std::vector<T>& values)  // NOLINT(runtime/explicit): a vector is a column
      : data_(values.data()), size_(values.size()) {}
  ArrayView(std::vector<T>&&) = delete;  // the view would outlive the values

  const T* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  const T* data_ = nullptr;
  size_t size_ = 0;
};

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
  // A stream's error answer, whose Error value carries them itself.
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
};

struct Proposal {
  uint64_t state_id = 0;
  std::vector<int32_t> tokens;
  std::vector<float> probs;
  float confidence = 0.0f;
  int64_t first_position = 0;
};

// One request of a ProposeBatch: a state and its Propose.
struct BatchRequest {
  uint64_t state = 0;
  ProposeArgs args;
};

// A verifier's step for B states as columns (ColumnsRequest): row i of every column is
// state_ids[i]'s. The views are read during the call only. The server checks that the
// columns fit together: lengths or shapes that do not fail the whole call with
// INVALID_ARGUMENT (reason COLUMNS_MISMATCH or BAD_SHAPE, field the column).
struct Columns {
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
};

// The answer to a Columns step, as columns: row i is state_ids[i]'s. A row that failed has
// count 0 and its error in `errors`; its state is unchanged.
struct ColumnsResult {
  int32_t width = 0;              // the largest K asked: the columns of drafts and probs
  std::vector<int32_t> drafts;    // [B, width] row-major: row i's counts[i] drafts, then -1
  std::vector<float> probs;       // [B, width]: each draft's top-1 probability, then 0
  std::vector<int32_t> counts;    // B values: drafts in each row
  std::vector<float> confidences;        // B values: each row's chain confidence
  std::vector<int64_t> first_positions;  // B values: the position of each row's first draft
  std::map<int32_t, DrafterError> errors;  // the failed rows' errors, by row

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
};

struct KVHandle {
  uint64_t handle_id = 0;
  int64_t num_rows = 0;
  double ttl_seconds = 0.0;
};

namespace internal {

// One bidirectional call whose answers are matched to their requests by request_id: the
// machinery of ProposeStream and ColumnsStream. `outcome` turns an answer into its result or
// throws the error it carries.
template <typename Request, typename Response, typename Result>
class StreamCall {
 public:
  using Call = grpc::ClientReaderWriter<Request, Response>;
  using Open = std::unique_ptr<Call> (pb::Drafter::Stub::*)(grpc::ClientContext*);
  using Outcome = Result (*)(const Response&);

  StreamCall(pb::Drafter::Stub& stub, Open open, Outcome outcome,
             std::chrono::milliseconds timeout, const std::string& affinity_key);
  ~StreamCall();  // Close()
  StreamCall(const StreamCall&) = delete;
  StreamCall& operator=(const StreamCall&) = delete;

  // Sends `req` with the next request_id.
  std::future<Result> Submit(Request req);
  grpc::Status Close();
  void Cancel();

 private:
  void Read();
  // What a request fails with once the stream has ended.
  grpc::Status Failure();

  Outcome outcome_;
  grpc::ClientContext context_;
  std::unique_ptr<Call> call_;
  std::mutex write_mu_;  // one write (or WritesDone, or Finish) at a time on the call
  bool writable_ = true;  // guarded by write_mu_: false after WritesDone or Finish
  std::mutex mu_;         // guards the fields below; taken after write_mu_, never before
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::promise<Result>> pending_;
  grpc::Status failure_;  // what Failure() returns
  grpc::Status status_;   // the call's final status, once the reader has finished it
  std::mutex close_mu_;  // one Close() joins the reader
  std::thread reader_;
};

// Defined, and instantiated for these two, in drafter_client.cc.
extern template class StreamCall<pb::ProposeRequest, pb::ProposeStreamResponse, Proposal>;
extern template class StreamCall<pb::ColumnsRequest, pb::ColumnsResponse, ColumnsResult>;

}  // namespace internal

// One ProposeStream call: many requests in flight, for any states, from any threads. Answers
// come as they are ready, matched to their requests by request_id. An error answer fails
// only its request; when the call itself ends (server gone, deadline, Cancel) every request
// in flight fails with its status, and so do later ones.
class ProposeStream {
 public:
  ~ProposeStream() = default;  // Close()
  ProposeStream(const ProposeStream&) = delete;
  ProposeStream& operator=(const ProposeStream&) = delete;

  // Sends one request; its future throws DrafterError for an error answer. Throws
  // DrafterError itself once the stream has ended or is closing.
  std::future<Proposal> Submit(uint64_t state, const ProposeArgs& args);
  // One verify step's round trip: Submit(state, args).get().
  Proposal Propose(uint64_t state, const ProposeArgs& args);
  // Ends the stream once the answers in flight have arrived; the call's final status.
  // Idempotent.
  grpc::Status Close() { return call_.Close(); }
  // Ends the call now: requests in flight fail with CANCELLED. Close() still joins.
  void Cancel() { call_.Cancel(); }

 private:
  friend class DrafterClient;
  ProposeStream(pb::Drafter::Stub& stub, std::chrono::milliseconds timeout,
                const std::string& affinity_key);

  internal::StreamCall<pb::ProposeRequest, pb::ProposeStreamResponse, Proposal> call_;
};

// One ProposeColumnsStream call: one message per verifier step, each a Columns step for many
// states, answered by one ColumnsResult matched by request_id. As on a ProposeStream, steps
// may be in flight at once from any threads; a step that fails as a whole (its columns do not
// fit together) throws its DrafterError and leaves the stream open, a row that fails has its
// error in the result's `errors`, and when the call itself ends every step in flight fails
// with its status.
class ColumnsStream {
 public:
  ~ColumnsStream() = default;  // Close()
  ColumnsStream(const ColumnsStream&) = delete;
  ColumnsStream& operator=(const ColumnsStream&) = delete;

  // Sends one step; its future throws DrafterError when the step failed as a whole. Throws
  // DrafterError itself once the stream has ended or is closing.
  std::future<ColumnsResult> Submit(const Columns& step);
  // One verifier step's round trip: Submit(step).get().
  ColumnsResult Step(const Columns& step);
  // Ends the stream once the answers in flight have arrived; the call's final status.
  // Idempotent.
  grpc::Status Close() { return call_.Close(); }
  // Ends the call now: steps in flight fail with CANCELLED. Close() still joins.
  void Cancel() { call_.Cancel(); }

 private:
  friend class DrafterClient;
  ColumnsStream(pb::Drafter::Stub& stub, std::chrono::milliseconds timeout,
                const std::string& affinity_key);

  internal::StreamCall<pb::ColumnsRequest, pb::ColumnsResponse, ColumnsResult> call_;
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
  // Appends rows (tokens[i], hiddens row i) at start_position + i, streamed in chunks of
  // chunk_rows rows (0: as many as fit in 4 MiB). All or nothing.
  PrefillResult Prefill(uint64_t state, int64_t start_position, const std::vector<int32_t>& tokens,
                        const Tensor& hiddens, int chunk_rows = 0);
  Proposal Propose(uint64_t state, const ProposeArgs& args);
  // Propose for many states in one batched call (at most GetInfo.max_batch, each state at
  // most once); the proposals in the order of the requests. All or nothing: one bad request
  // fails the call and changes no state. No requests: no call.
  std::vector<Proposal> ProposeBatch(const std::vector<BatchRequest>& requests);
  // A verifier's whole step for B states in one message, as columns (at most
  // GetInfo.max_batch rows, each state at most once). A row that fails has its error in
  // the result's `errors` and leaves its state unchanged; columns that do not fit together
  // fail the call.
  ColumnsResult ProposeColumns(const Columns& step);
  // The hot path: a ProposeStream. `timeout` is the whole stream's deadline; zero (the
  // default) sets none, since a stream lives as long as its verifier, not one call (the
  // client's own timeout is not applied).
  std::unique_ptr<ProposeStream> OpenStream(
      std::chrono::milliseconds timeout = std::chrono::milliseconds::zero());
  // The columnar hot path: a ProposeColumnsStream, one message per verifier step. `timeout`
  // as for OpenStream.
  std::unique_ptr<ColumnsStream> OpenColumnsStream(
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
