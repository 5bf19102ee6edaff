#include "mtpdraft/drafter_client.h"

#include <algorithm>
#include <cstring>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace mtpdraft {
namespace {

constexpr int64_t kDefaultChunkBytes = 4 << 20;
// The request metadata a proxy routes by (deploy/README.md).
constexpr char kAffinityHeader[] = "x-mtpdraft-affinity";

// Little-endian bytes of 32-bit words, whatever the host's byte order.
std::string PackLE32(const uint32_t* words, size_t n) {
  std::string out(n * 4, '\0');
  for (size_t i = 0; i < n; ++i) {
    for (int b = 0; b < 4; ++b) out[4 * i + b] = static_cast<char>((words[i] >> (8 * b)) & 0xff);
  }
  return out;
}

std::vector<int64_t> ShapeOr(std::vector<int64_t> shape, size_t n) {
  if (shape.empty()) shape.push_back(static_cast<int64_t>(n));
  return shape;
}

void Check(const grpc::Status& status) {
  if (!status.ok()) throw DrafterError(status);
}

}  // namespace

Tensor Tensor::FP32(const std::vector<float>& values, std::vector<int64_t> shape) {
  return FP32(values.data(), ShapeOr(std::move(shape), values.size()));
}

Tensor Tensor::FP32(const float* values, std::vector<int64_t> shape) {
  size_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("a negative tensor dimension");
    n *= static_cast<size_t>(d);
  }
  std::vector<uint32_t> words(n);
  if (n > 0) std::memcpy(words.data(), values, n * 4);
  return {pb::DTYPE_FP32, std::move(shape), PackLE32(words.data(), words.size())};
}

Tensor Tensor::Int32(const std::vector<int32_t>& values, std::vector<int64_t> shape) {
  std::vector<uint32_t> words(values.begin(), values.end());
  return {pb::DTYPE_INT32, ShapeOr(std::move(shape), values.size()),
          PackLE32(words.data(), words.size())};
}

int Tensor::ItemSize(pb::DType dtype) {
  switch (dtype) {
    case pb::DTYPE_BF16:
    case pb::DTYPE_FP16:
      return 2;
    case pb::DTYPE_FP32:
    case pb::DTYPE_INT32:
      return 4;
    default:
      return 0;
  }
}

void Tensor::ToProto(pb::Tensor* out) const {
  out->set_dtype(dtype);
  for (int64_t d : shape) out->add_shape(d);
  out->set_data(data);
}

std::string StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "CODE_" + std::to_string(static_cast<int>(code));
  }
}

DrafterError::DrafterError(const grpc::Status& status) : DrafterError(status, "", "") {
  google::rpc::Status details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) return;
  for (const google::protobuf::Any& any : details.details()) {
    google::rpc::ErrorInfo info;
    google::rpc::BadRequest bad;
    if (any.UnpackTo(&info)) {
      reason_ = info.reason();
    } else if (any.UnpackTo(&bad) && bad.field_violations_size() > 0) {
      field_ = bad.field_violations(0).field();
    }
  }
}

DrafterError::DrafterError(const grpc::Status& status, std::string reason, std::string field)
    : std::runtime_error(StatusCodeName(status.error_code()) + ": " + status.error_message()),
      status_(status),
      reason_(std::move(reason)),
      field_(std::move(field)) {}

std::string DrafterError::code_name() const { return StatusCodeName(code()); }

DrafterClient::DrafterClient(const std::string& address, std::chrono::milliseconds timeout)
    : DrafterClient(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), timeout) {}

DrafterClient::DrafterClient(std::shared_ptr<grpc::Channel> channel,
                             std::chrono::milliseconds timeout)
    : channel_(std::move(channel)), stub_(pb::Drafter::NewStub(channel_)), timeout_(timeout) {}

void DrafterClient::Prepare(grpc::ClientContext* context) const {
  if (timeout_.count() > 0) context->set_deadline(std::chrono::system_clock::now() + timeout_);
  if (!affinity_key_.empty()) context->AddMetadata(kAffinityHeader, affinity_key_);
}

pb::GetInfoResponse DrafterClient::GetInfo() {
  grpc::ClientContext context;
  Prepare(&context);
  pb::GetInfoResponse resp;
  Check(stub_->GetInfo(&context, pb::GetInfoRequest(), &resp));
  return resp;
}

uint64_t DrafterClient::AllocState() {
  grpc::ClientContext context;
  Prepare(&context);
  pb::AllocStateResponse resp;
  Check(stub_->AllocState(&context, pb::AllocStateRequest(), &resp));
  return resp.state_id();
}

PrefillResult DrafterClient::Prefill(uint64_t state, int64_t start_position,
                                     const std::vector<int32_t>& tokens, const Tensor& hiddens,
                                     int chunk_rows) {
  const int64_t rows = static_cast<int64_t>(tokens.size());
  if (hiddens.shape.size() != 2 || hiddens.shape[0] != rows) {
    throw std::invalid_argument("hiddens shape does not match the tokens");
  }
  const int64_t width = hiddens.shape[1];
  const int64_t row_bytes = width * Tensor::ItemSize(hiddens.dtype);
  if (chunk_rows <= 0) {
    chunk_rows = static_cast<int>(std::max<int64_t>(1, (kDefaultChunkBytes - 64) / (row_bytes + 5)));
  }
  grpc::ClientContext context;
  Prepare(&context);
  pb::PrefillResponse resp;
  std::unique_ptr<grpc::ClientWriter<pb::PrefillChunk>> writer(stub_->Prefill(&context, &resp));
  PrefillResult result;
  for (int64_t lo = 0; lo < rows || lo == 0; lo += chunk_rows) {
    const int64_t hi = std::min<int64_t>(lo + chunk_rows, rows);
    pb::PrefillChunk chunk;
    if (lo == 0) {  // the first chunk names the state, the start and the row count (so
                    // that a stream cut short is rolled back); later ones continue it
      chunk.set_state_id(state);
      chunk.set_start_position(start_position);
      chunk.set_total_rows(rows);
    }
    for (int64_t i = lo; i < hi; ++i) chunk.add_tokens(tokens[i]);
    pb::Tensor* h = chunk.mutable_hiddens();
    h->set_dtype(hiddens.dtype);
    h->add_shape(hi - lo);
    h->add_shape(width);
    h->set_data(hiddens.data.substr(lo * row_bytes, (hi - lo) * row_bytes));
    if (!writer->Write(chunk)) break;  // the server ended the call: Finish() says why
    ++result.chunks;
  }
  writer->WritesDone();
  Check(writer->Finish());
  result.num_rows = resp.num_rows();
  result.next_position = resp.next_position();
  return result;
}

namespace {
void FillVerdict(const Verdict& v, pb::Verdict* out) {
  out->set_num_accepted(v.num_accepted);
  if (v.refeed_hiddens) v.refeed_hiddens->ToProto(out->mutable_refeed_hiddens());
}

// The request of a Propose, unary or on a stream.
pb::ProposeRequest ProposeRequestOf(uint64_t state, const ProposeArgs& args) {
  pb::ProposeRequest req;
  req.set_state_id(state);
  req.set_token(args.token);
  args.hidden.ToProto(req.mutable_hidden());
  req.set_position(args.position);
  req.set_num_drafts(args.num_drafts);
  if (args.bitmask) args.bitmask->ToProto(req.mutable_bitmask());
  req.set_min_confidence(args.min_confidence);
  if (args.previous) FillVerdict(*args.previous, req.mutable_previous());
  return req;
}

Proposal ProposalOf(const pb::Proposal& p) {
  return {p.state_id(), {p.tokens().begin(), p.tokens().end()},
          {p.probs().begin(), p.probs().end()}, p.confidence(), p.first_position()};
}

// An error answer as the status the unary call would have failed with. A code this client
// does not know, or OK (which no error has), reads as UNKNOWN.
grpc::Status StatusOf(const pb::Error& error) {
  int code = error.code();
  if (code <= grpc::StatusCode::OK || code > grpc::StatusCode::UNAUTHENTICATED) {
    code = grpc::StatusCode::UNKNOWN;
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code), error.message());
}

// Why requests fail once a stream has ended cleanly or is closing.
grpc::Status StreamClosed() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the propose stream is closed");
}

// A ColumnsRequest of a Columns step, its columns copied as they are (the server checks
// that they fit together).
pb::ColumnsRequest ColumnsRequestOf(const Columns& step) {
  pb::ColumnsRequest req;
  req.mutable_state_ids()->Add(step.state_ids.begin(), step.state_ids.end());
  req.mutable_tokens()->Add(step.tokens.begin(), step.tokens.end());
  req.mutable_positions()->Add(step.positions.begin(), step.positions.end());
  step.hiddens.ToProto(req.mutable_hiddens());
  req.mutable_num_drafts()->Add(step.num_drafts.begin(), step.num_drafts.end());
  req.mutable_num_accepted()->Add(step.num_accepted.begin(), step.num_accepted.end());
  req.mutable_refeed_rows()->Add(step.refeed_rows.begin(), step.refeed_rows.end());
  if (step.refeed_hiddens) step.refeed_hiddens->ToProto(req.mutable_refeed_hiddens());
  req.mutable_bitmask_rows()->Add(step.bitmask_rows.begin(), step.bitmask_rows.end());
  if (step.bitmasks) step.bitmasks->ToProto(req.mutable_bitmasks());
  req.mutable_min_confidence()->Add(step.min_confidence.begin(), step.min_confidence.end());
  return req;
}

// An answer this client cannot read.
DrafterError BadAnswer(const std::string& what) {
  return DrafterError(grpc::Status(grpc::StatusCode::UNKNOWN, "a malformed answer: " + what));
}

// A ColumnsResponse's columns; throws unless they fit together, so that the result's row
// accessors stay within its vectors.
ColumnsResult ColumnsResultOf(const pb::ColumnsResponse& resp) {
  ColumnsResult r;
  r.width = resp.width();
  r.drafts.assign(resp.drafts().begin(), resp.drafts().end());
  r.probs.assign(resp.probs().begin(), resp.probs().end());
  r.counts.assign(resp.draft_counts().begin(), resp.draft_counts().end());
  r.confidences.assign(resp.confidences().begin(), resp.confidences().end());
  r.first_positions.assign(resp.first_positions().begin(), resp.first_positions().end());
  const size_t rows = r.counts.size();
  if (r.width < 0) throw BadAnswer("a negative width");
  if (r.drafts.size() != rows * r.width || r.probs.size() != rows * r.width) {
    throw BadAnswer("drafts or probs are not [B, width]");
  }
  if (r.confidences.size() != rows || r.first_positions.size() != rows) {
    throw BadAnswer("confidences or first_positions do not have B values");
  }
  for (int32_t count : r.counts) {
    if (count < 0 || count > r.width) throw BadAnswer("a draft count outside 0 .. width");
  }
  for (const pb::RowError& e : resp.errors()) {
    if (e.row() < 0 || static_cast<size_t>(e.row()) >= rows) {
      throw BadAnswer("an error for row " + std::to_string(e.row()));
    }
    r.errors.insert_or_assign(
        e.row(), DrafterError(StatusOf(e.error()), e.error().reason(), e.error().field()));
  }
  return r;
}

// A ProposeStream answer's proposal, or the error it carries.
Proposal ProposeOutcome(const pb::ProposeStreamResponse& resp) {
  switch (resp.result_case()) {
    case pb::ProposeStreamResponse::kProposal:
      return ProposalOf(resp.proposal());
    case pb::ProposeStreamResponse::kError:
      throw DrafterError(StatusOf(resp.error()), resp.error().reason(), resp.error().field());
    default:  // a result this client does not know
      throw DrafterError(grpc::Status(grpc::StatusCode::UNKNOWN, "an answer with no known result"));
  }
}

// A ProposeColumnsStream answer's result, or the error of a step that failed as a whole.
ColumnsResult ColumnsOutcome(const pb::ColumnsResponse& resp) {
  if (resp.has_error()) {
    throw DrafterError(StatusOf(resp.error()), resp.error().reason(), resp.error().field());
  }
  return ColumnsResultOf(resp);
}
}  // namespace

Proposal DrafterClient::Propose(uint64_t state, const ProposeArgs& args) {
  pb::ProposeRequest req = ProposeRequestOf(state, args);
  grpc::ClientContext context;
  Prepare(&context);
  pb::Proposal resp;
  Check(stub_->Propose(&context, req, &resp));
  return ProposalOf(resp);
}

std::vector<Proposal> DrafterClient::ProposeBatch(const std::vector<BatchRequest>& requests) {
  if (requests.empty()) return {};
  pb::ProposeBatchRequest req;
  for (const BatchRequest& r : requests) *req.add_requests() = ProposeRequestOf(r.state, r.args);
  grpc::ClientContext context;
  Prepare(&context);
  pb::ProposeBatchResponse resp;
  Check(stub_->ProposeBatch(&context, req, &resp));
  if (static_cast<size_t>(resp.proposals_size()) != requests.size()) {
    throw BadAnswer(std::to_string(resp.proposals_size()) + " proposals for " +
                    std::to_string(requests.size()) + " requests");
  }
  std::vector<Proposal> out;
  out.reserve(requests.size());
  for (const pb::Proposal& p : resp.proposals()) out.push_back(ProposalOf(p));
  return out;
}

ColumnsResult DrafterClient::ProposeColumns(const Columns& step) {
  pb::ColumnsRequest req = ColumnsRequestOf(step);
  grpc::ClientContext context;
  Prepare(&context);
  pb::ColumnsResponse resp;
  Check(stub_->ProposeColumns(&context, req, &resp));
  ColumnsResult result = ColumnsResultOf(resp);
  if (result.size() != step.state_ids.size()) {
    throw BadAnswer(std::to_string(result.size()) + " rows for " +
                    std::to_string(step.state_ids.size()) + " states");
  }
  return result;
}

std::unique_ptr<ProposeStream> DrafterClient::OpenStream(std::chrono::milliseconds timeout) {
  return std::unique_ptr<ProposeStream>(new ProposeStream(*stub_, timeout, affinity_key_));
}

std::unique_ptr<ColumnsStream> DrafterClient::OpenColumnsStream(
    std::chrono::milliseconds timeout) {
  return std::unique_ptr<ColumnsStream>(new ColumnsStream(*stub_, timeout, affinity_key_));
}

ProposeStream::ProposeStream(pb::Drafter::Stub& stub, std::chrono::milliseconds timeout,
                             const std::string& affinity_key)
    : call_(stub, &pb::Drafter::Stub::ProposeStream, &ProposeOutcome, timeout, affinity_key) {}

std::future<Proposal> ProposeStream::Submit(uint64_t state, const ProposeArgs& args) {
  return call_.Submit(ProposeRequestOf(state, args));
}

Proposal ProposeStream::Propose(uint64_t state, const ProposeArgs& args) {
  return Submit(state, args).get();
}

ColumnsStream::ColumnsStream(pb::Drafter::Stub& stub, std::chrono::milliseconds timeout,
                             const std::string& affinity_key)
    : call_(stub, &pb::Drafter::Stub::ProposeColumnsStream, &ColumnsOutcome, timeout,
            affinity_key) {}

std::future<ColumnsResult> ColumnsStream::Submit(const Columns& step) {
  return call_.Submit(ColumnsRequestOf(step));
}

ColumnsResult ColumnsStream::Step(const Columns& step) { return Submit(step).get(); }

namespace internal {

template <typename Request, typename Response, typename Result>
StreamCall<Request, Response, Result>::StreamCall(pb::Drafter::Stub& stub, Open open,
                                                  Outcome outcome,
                                                  std::chrono::milliseconds timeout,
                                                  const std::string& affinity_key)
    : outcome_(outcome), failure_(StreamClosed()) {
  if (timeout.count() > 0) context_.set_deadline(std::chrono::system_clock::now() + timeout);
  if (!affinity_key.empty()) context_.AddMetadata(kAffinityHeader, affinity_key);
  call_ = (stub.*open)(&context_);
  reader_ = std::thread(&StreamCall::Read, this);
}

template <typename Request, typename Response, typename Result>
StreamCall<Request, Response, Result>::~StreamCall() {
  Close();
}

template <typename Request, typename Response, typename Result>
std::future<Result> StreamCall<Request, Response, Result>::Submit(Request req) {
  std::promise<Result> promise;
  std::future<Result> future = promise.get_future();
  std::lock_guard<std::mutex> write_lock(write_mu_);
  // gRPC allows no write after WritesDone or Finish: say why the stream is over instead.
  if (!writable_) throw DrafterError(Failure());
  {
    std::lock_guard<std::mutex> lock(mu_);
    req.set_request_id(next_id_++);
    pending_.emplace(req.request_id(), std::move(promise));
  }
  // False when the call has ended: the reader then fails the promise with its status.
  call_->Write(req);
  return future;
}

template <typename Request, typename Response, typename Result>
grpc::Status StreamCall<Request, Response, Result>::Failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

template <typename Request, typename Response, typename Result>
void StreamCall<Request, Response, Result>::Read() {
  Response resp;
  while (call_->Read(&resp)) {
    typename std::map<uint64_t, std::promise<Result>>::node_type answered;
    {
      std::lock_guard<std::mutex> lock(mu_);
      answered = pending_.extract(resp.request_id());
    }
    if (answered.empty()) continue;  // not a request of this stream
    std::promise<Result>& promise = answered.mapped();
    try {
      promise.set_value(outcome_(resp));
    } catch (...) {  // the error the answer carries, or an answer this client cannot read
      promise.set_exception(std::current_exception());
    }
  }
  // The server has ended the call: no answer will come for what is still pending.
  std::map<uint64_t, std::promise<Result>> pending;
  grpc::Status failure;
  {
    std::lock_guard<std::mutex> write_lock(write_mu_);  // no Write may start after Finish
    writable_ = false;
    grpc::Status status = call_->Finish();
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
    if (!status.ok()) failure_ = status;
    failure = failure_;
    pending.swap(pending_);
  }
  for (auto& [id, promise] : pending) {
    promise.set_exception(std::make_exception_ptr(DrafterError(failure)));
  }
}

template <typename Request, typename Response, typename Result>
grpc::Status StreamCall<Request, Response, Result>::Close() {
  std::lock_guard<std::mutex> close_lock(close_mu_);
  {
    std::lock_guard<std::mutex> write_lock(write_mu_);
    if (writable_) {
      writable_ = false;
      call_->WritesDone();  // the server answers what is in flight, then ends the call
    }
  }
  if (reader_.joinable()) reader_.join();
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

template <typename Request, typename Response, typename Result>
void StreamCall<Request, Response, Result>::Cancel() {
  context_.TryCancel();
}

template class StreamCall<pb::ProposeRequest, pb::ProposeStreamResponse, Proposal>;
template class StreamCall<pb::ColumnsRequest, pb::ColumnsResponse, ColumnsResult>;

}  // namespace internal

Rows DrafterClient::AfterVerify(uint64_t state, int32_t num_accepted,
                                const std::optional<Tensor>& refeed_hiddens) {
  pb::AfterVerifyRequest req;
  req.set_state_id(state);
  FillVerdict({num_accepted, refeed_hiddens}, req.mutable_verdict());
  grpc::ClientContext context;
  Prepare(&context);
  pb::AfterVerifyResponse resp;
  Check(stub_->AfterVerify(&context, req, &resp));
  return {resp.num_rows(), resp.next_position()};
}

KVHandle DrafterClient::TakeKV(uint64_t state) {
  pb::TakeKVRequest req;
  req.set_state_id(state);
  grpc::ClientContext context;
  Prepare(&context);
  pb::TakeKVResponse resp;
  Check(stub_->TakeKV(&context, req, &resp));
  return {resp.handle_id(), resp.num_rows(), resp.ttl_seconds()};
}

Rows DrafterClient::InstallKV(uint64_t state, uint64_t handle) {
  pb::InstallKVRequest req;
  req.set_state_id(state);
  req.set_handle_id(handle);
  grpc::ClientContext context;
  Prepare(&context);
  pb::InstallKVResponse resp;
  Check(stub_->InstallKV(&context, req, &resp));
  return {resp.num_rows(), resp.next_position()};
}

bool DrafterClient::FreeState(uint64_t state) {
  pb::FreeStateRequest req;
  req.set_state_id(state);
  grpc::ClientContext context;
  Prepare(&context);
  pb::FreeStateResponse resp;
  Check(stub_->FreeState(&context, req, &resp));
  return resp.existed();
}

}  // namespace mtpdraft
