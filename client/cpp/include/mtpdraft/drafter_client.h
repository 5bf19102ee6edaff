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
// Tensors are raw little-endian bytes with a dtype and a shape. A failed RPC throws
// mtpdraft::DrafterError, whose code() is the grpc::StatusCode and reason() and field()
// say why; so does a stream's error answer, which leaves the stream open.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mtpdraft/v1/drafter.grpc.pb.h"

namespace mtpdraft {

namespace pb = ::mtpdraft::v1;

// A dense tensor: raw little-endian bytes in row-major order, a dtype and a shape.
struct Tensor {
  pb::DType dtype = pb::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  std::string data;  // raw bytes

  static Tensor FP32(const std::vector<float>& values, std::vector<int64_t> shape = {});
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

struct KVHandle {
  uint64_t handle_id = 0;
  int64_t num_rows = 0;
  double ttl_seconds = 0.0;
};

// One ProposeStream call: many requests in flight, for any states, from any threads. Answers
// come as they are ready, matched to their requests by request_id. An error answer fails
// only its request; when the call itself ends (server gone, deadline, Cancel) every request
// in flight fails with its status, and so do later ones.
class ProposeStream {
 public:
  ~ProposeStream();  // Close()
  ProposeStream(const ProposeStream&) = delete;
  ProposeStream& operator=(const ProposeStream&) = delete;

  // Sends one request; its future throws DrafterError for an error answer. Throws
  // DrafterError itself once the stream has ended or is closing.
  std::future<Proposal> Submit(uint64_t state, const ProposeArgs& args);
  // One verify step's round trip: Submit(state, args).get().
  Proposal Propose(uint64_t state, const ProposeArgs& args);
  // Ends the stream once the answers in flight have arrived; the call's final status.
  // Idempotent.
  grpc::Status Close();
  // Ends the call now: requests in flight fail with CANCELLED. Close() still joins.
  void Cancel();

 private:
  friend class DrafterClient;
  ProposeStream(pb::Drafter::Stub& stub, std::chrono::milliseconds timeout);
  void Read();
  // What a request fails with once the stream has ended.
  grpc::Status Failure();

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::ProposeRequest, pb::ProposeStreamResponse>> call_;
  std::mutex write_mu_;  // one write (or WritesDone, or Finish) at a time on the call
  bool writable_ = true;  // guarded by write_mu_: false after WritesDone or Finish
  std::mutex mu_;         // guards the fields below; taken after write_mu_, never before
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::promise<Proposal>> pending_;
  grpc::Status failure_;  // what Failure() returns
  grpc::Status status_;   // the call's final status, once the reader has finished it
  std::mutex close_mu_;  // one Close() joins the reader
  std::thread reader_;
};

class DrafterClient {
 public:
  // An insecure channel to `address` ("host:port"); `timeout` is every call's deadline.
  explicit DrafterClient(const std::string& address,
                         std::chrono::milliseconds timeout = std::chrono::seconds(30));
  explicit DrafterClient(std::shared_ptr<grpc::Channel> channel,
                         std::chrono::milliseconds timeout = std::chrono::seconds(30));

  pb::GetInfoResponse GetInfo();
  uint64_t AllocState();
  // Appends rows (tokens[i], hiddens row i) at start_position + i, streamed in chunks of
  // chunk_rows rows (0: as many as fit in 4 MiB). All or nothing.
  PrefillResult Prefill(uint64_t state, int64_t start_position, const std::vector<int32_t>& tokens,
                        const Tensor& hiddens, int chunk_rows = 0);
  Proposal Propose(uint64_t state, const ProposeArgs& args);
  // The hot path: a ProposeStream. `timeout` is the whole stream's deadline; zero (the
  // default) sets none, since a stream lives as long as its verifier, not one call.
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
};

}  // namespace mtpdraft
