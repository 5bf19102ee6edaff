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
// Tensors are raw little-endian bytes with a dtype and a shape. A failed RPC throws
// mtpdraft::DrafterError, whose code() is the grpc::StatusCode.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
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

// A failed RPC: the gRPC status code and message.
class DrafterError : public std::runtime_error {
 public:
  explicit DrafterError(const grpc::Status& status);
  grpc::StatusCode code() const { return status_.error_code(); }
  const grpc::Status& status() const { return status_; }
  // The canonical name of the code, e.g. "NOT_FOUND".
  std::string code_name() const;

 private:
  grpc::Status status_;
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
