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

uint64_t DrafterClient::AllocState() { return AllocState(StateOptions{}); }

uint64_t DrafterClient::AllocState(const pb::Grammar& grammar) {
  StateOptions options;
  if (grammar.kind_case() != pb::Grammar::KIND_NOT_SET) options.grammar = grammar;
  return AllocState(options);
}

uint64_t DrafterClient::AllocState(const StateOptions& options) {
  grpc::ClientContext context;
  Prepare(&context);
  pb::AllocStateRequest req;
  if (options.sampling) *req.mutable_sampling() = *options.sampling;
  if (options.grammar) *req.mutable_grammar() = *options.grammar;
  pb::AllocStateResponse resp;
  Check(stub_->AllocState(&context, req, &resp));
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

// The request of a unary Propose.
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
  req.set_step_number(args.step_number);
  req.set_return_bitmasks(args.return_bitmasks);
  if (args.sampling) *req.mutable_sampling() = *args.sampling;
  if (args.grammar) *req.mutable_grammar() = *args.grammar;
  req.set_draft_cap(args.draft_cap);
  req.set_verify_token_cost(args.verify_token_cost);
  return req;
}

// An int32 tensor's values (its raw little-endian bytes, as the wire carries them).
std::vector<int32_t> Int32s(const pb::Tensor& t) {
  std::vector<int32_t> out(t.data().size() / 4);
  for (size_t i = 0; i < out.size(); ++i) {
    const auto* b = reinterpret_cast<const unsigned char*>(t.data().data()) + 4 * i;
    out[i] = static_cast<int32_t>(uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 |
                                  uint32_t{b[3]} << 24);
  }
  return out;
}

Proposal ProposalOf(const pb::Proposal& p) {
  return {p.state_id(), {p.tokens().begin(), p.tokens().end()},
          {p.probs().begin(), p.probs().end()}, p.confidence(), p.first_position(),
          p.has_bitmasks() ? Int32s(p.bitmasks()) : std::vector<int32_t>(),
          p.q_support(), {p.q_ids().begin(), p.q_ids().end()},
          {p.q_probs().begin(), p.q_probs().end()}};
}

// An error carried as a value as the status a unary call would have failed with. A code this client
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

// A ProposeBatchRequest of a Batch, its columns copied as they are (the server checks that
// they fit together).
pb::ProposeBatchRequest BatchRequestOf(const Batch& step) {
  pb::ProposeBatchRequest req;
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
  req.mutable_step_numbers()->Add(step.step_numbers.begin(), step.step_numbers.end());
  req.set_return_bitmasks(step.return_bitmasks);
  req.mutable_sampling_rows()->Add(step.sampling_rows.begin(), step.sampling_rows.end());
  for (const pb::SamplingParams& s : step.sampling) *req.add_sampling() = s;
  req.mutable_grammar_rows()->Add(step.grammar_rows.begin(), step.grammar_rows.end());
  for (const pb::Grammar& g : step.grammars) *req.add_grammars() = g;
  req.mutable_draft_caps()->Add(step.draft_caps.begin(), step.draft_caps.end());
  req.mutable_verify_token_costs()->Add(step.verify_token_costs.begin(),
                                        step.verify_token_costs.end());
  return req;
}

// An answer this client cannot read.
DrafterError BadAnswer(const std::string& what) {
  return DrafterError(grpc::Status(grpc::StatusCode::UNKNOWN, "a malformed answer: " + what));
}

// A ProposeBatchResponse's columns, the answer to a batch of `state_ids`; throws unless they
// fit together, so that the result's row accessors stay within its vectors.
BatchResult BatchResultOf(const pb::ProposeBatchResponse& resp, std::vector<uint64_t> state_ids) {
  BatchResult r;
  r.state_ids = std::move(state_ids);
  r.width = resp.width();
  r.drafts.assign(resp.drafts().begin(), resp.drafts().end());
  r.probs.assign(resp.probs().begin(), resp.probs().end());
  r.counts.assign(resp.draft_counts().begin(), resp.draft_counts().end());
  r.confidences.assign(resp.confidences().begin(), resp.confidences().end());
  r.first_positions.assign(resp.first_positions().begin(), resp.first_positions().end());
  const size_t rows = r.counts.size();
  if (rows != r.state_ids.size()) {
    throw BadAnswer(std::to_string(rows) + " rows for " + std::to_string(r.state_ids.size()) +
                    " states");
  }
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
  r.bitmask_rows.assign(resp.bitmask_rows().begin(), resp.bitmask_rows().end());
  if (resp.has_bitmasks()) r.bitmasks = Int32s(resp.bitmasks());
  r.q_support = resp.q_support();
  r.q_ids.assign(resp.q_ids().begin(), resp.q_ids().end());
  r.q_probs.assign(resp.q_probs().begin(), resp.q_probs().end());
  const size_t cells = rows * r.width * static_cast<size_t>(std::max(r.q_support, 0));
  if (r.q_support < 0 || r.q_ids.size() != cells || r.q_probs.size() != cells) {
    throw BadAnswer("q_ids or q_probs are not [B, width, q_support]");
  }
  return r;
}

// The rows of one tensor column, gathered state by state (BatchOf).
class ColumnRows {
 public:
  ColumnRows(const char* name, bool pad) : name_(name), pad_(pad) {}

  // Adds requests[i]'s rows ([n, width], or one row flat); returns how many.
  int32_t Add(const Tensor& t, size_t i) {
    const std::string where = "requests[" + std::to_string(i) + "]." + name_;
    if (t.shape.empty() || t.shape.size() > 2) throw std::invalid_argument(where + ": not rows");
    const int64_t width = t.shape.back();
    const int64_t n = t.shape.size() == 1 ? (width > 0 ? 1 : 0) : t.shape[0];
    if (n == 0) return 0;
    if (count_ > 0 && t.dtype != dtype_) {
      throw std::invalid_argument(where + ": another dtype than the rows before");
    }
    if (count_ > 0 && width != width_ && !pad_) {
      throw std::invalid_argument(where + ": another width than the rows before");
    }
    dtype_ = t.dtype;
    width_ = std::max(width_, width);
    parts_.push_back({n, width, &t.data});
    count_ += n;
    return static_cast<int32_t>(n);
  }

  int64_t count() const { return count_; }

  // The rows as one [count, width] tensor, narrower rows padded with zero bytes.
  Tensor Stacked() const {
    const int64_t size = Tensor::ItemSize(dtype_);
    std::string data;
    data.reserve(count_ * width_ * size);
    for (const Part& p : parts_) {
      for (int64_t r = 0; r < p.n; ++r) {
        data.append(*p.data, r * p.width * size, p.width * size);
        data.append((width_ - p.width) * size, '\0');
      }
    }
    return {dtype_, {count_, width_}, std::move(data)};
  }

 private:
  struct Part {
    int64_t n, width;
    const std::string* data;  // the caller's tensor's, read by Stacked() while BatchOf runs
  };
  std::string name_;
  bool pad_;
  pb::DType dtype_ = pb::DTYPE_UNSPECIFIED;
  int64_t width_ = 0, count_ = 0;
  std::vector<Part> parts_;
};
}  // namespace

StatesBatch BatchOf(const std::vector<BatchRequest>& requests) {
  StatesBatch b;
  ColumnRows hiddens("hidden", false), refeeds("previous.refeed_hiddens", false);
  ColumnRows masks("bitmask", true);
  bool verdicts = false, floors = false, numbered = false, chosen = false;
  for (size_t i = 0; i < requests.size(); ++i) {
    const BatchRequest& r = requests[i];
    if (r.args.sampling) {
      b.sampling_rows.push_back(static_cast<int32_t>(i));
      b.sampling.push_back(*r.args.sampling);
    }
    if (r.args.grammar) {
      b.grammar_rows.push_back(static_cast<int32_t>(i));
      b.grammars.push_back(*r.args.grammar);
    }
    b.draft_caps.push_back(r.args.draft_cap);
    b.verify_token_costs.push_back(r.args.verify_token_cost);
    chosen = chosen || r.args.draft_cap != 0 || r.args.verify_token_cost != 0.0f;
    b.state_ids.push_back(r.state);
    b.tokens.push_back(r.args.token);
    b.positions.push_back(r.args.position);
    b.num_drafts.push_back(r.args.num_drafts);
    b.min_confidence.push_back(r.args.min_confidence);
    floors = floors || r.args.min_confidence != 0.0f;
    b.step_numbers.push_back(r.args.step_number);
    numbered = numbered || r.args.step_number != 0;
    if (hiddens.Add(r.args.hidden, i) != 1) {
      throw std::invalid_argument("requests[" + std::to_string(i) + "].hidden: one row expected");
    }
    const std::optional<Verdict>& v = r.args.previous;
    verdicts = verdicts || v.has_value();
    b.num_accepted.push_back(v ? v->num_accepted : -1);
    b.refeed_rows.push_back(v && v->refeed_hiddens ? refeeds.Add(*v->refeed_hiddens, i) : 0);
    b.bitmask_rows.push_back(r.args.bitmask ? masks.Add(*r.args.bitmask, i) : 0);
  }
  b.hiddens = hiddens.Stacked();
  if (!verdicts) b.num_accepted.clear();
  if (refeeds.count() > 0) {
    b.refeed_hiddens = refeeds.Stacked();
  } else {
    b.refeed_rows.clear();
  }
  if (masks.count() > 0) {
    b.bitmasks = masks.Stacked();
  } else {
    b.bitmask_rows.clear();
  }
  if (!floors) b.min_confidence.clear();
  if (!numbered) b.step_numbers.clear();
  if (!chosen) b.draft_caps.clear(), b.verify_token_costs.clear();
  return b;
}

Batch StatesBatch::batch() const {
  Batch b;
  b.state_ids = state_ids, b.tokens = tokens, b.positions = positions, b.hiddens = hiddens;
  b.num_drafts = num_drafts, b.num_accepted = num_accepted, b.refeed_rows = refeed_rows;
  b.refeed_hiddens = refeed_hiddens, b.bitmask_rows = bitmask_rows, b.bitmasks = bitmasks;
  b.min_confidence = min_confidence, b.step_numbers = step_numbers;
  b.sampling_rows = sampling_rows, b.sampling = sampling;
  b.grammar_rows = grammar_rows, b.grammars = grammars;
  b.draft_caps = draft_caps, b.verify_token_costs = verify_token_costs;
  return b;
}

Proposal BatchResult::RowProposal(size_t row) const {
  if (const DrafterError* e = Error(row)) throw *e;
  ArrayView<int32_t> tokens = Drafts(row);
  ArrayView<float> row_probs = Probs(row);
  Proposal p{state_ids[row], {tokens.begin(), tokens.end()}, {row_probs.begin(), row_probs.end()},
             confidences[row], first_positions[row]};
  if (q_support > 0) {
    const size_t lo = row * width * q_support, hi = lo + tokens.size() * q_support;
    p.q_support = q_support;
    p.q_ids.assign(q_ids.begin() + lo, q_ids.begin() + hi);
    p.q_probs.assign(q_probs.begin() + lo, q_probs.begin() + hi);
  }
  return p;
}

Proposal DrafterClient::Propose(uint64_t state, const ProposeArgs& args) {
  pb::ProposeRequest req = ProposeRequestOf(state, args);
  grpc::ClientContext context;
  Prepare(&context);
  pb::Proposal resp;
  Check(stub_->Propose(&context, req, &resp));
  return ProposalOf(resp);
}

BatchResult DrafterClient::ProposeBatch(const Batch& step) {
  pb::ProposeBatchRequest req = BatchRequestOf(step);
  grpc::ClientContext context;
  Prepare(&context);
  pb::ProposeBatchResponse resp;
  Check(stub_->ProposeBatch(&context, req, &resp));
  return BatchResultOf(resp, {req.state_ids().begin(), req.state_ids().end()});
}

std::unique_ptr<ProposeStream> DrafterClient::OpenStream(std::chrono::milliseconds timeout) {
  return std::unique_ptr<ProposeStream>(new ProposeStream(*stub_, timeout, affinity_key_));
}

std::future<BatchResult> ProposeStream::Submit(const Batch& step) {
  return call_.Submit(BatchRequestOf(step));
}

BatchResult ProposeStream::Step(const Batch& step) { return Submit(step).get(); }

Proposal ProposeStream::Propose(uint64_t state, const ProposeArgs& args) {
  const StatesBatch one = BatchOf({{state, args}});
  return Step(one.batch()).RowProposal(0);
}

namespace internal {

StreamCall::StreamCall(pb::Drafter::Stub& stub, std::chrono::milliseconds timeout,
                       const std::string& affinity_key)
    : failure_(StreamClosed()) {
  if (timeout.count() > 0) context_.set_deadline(std::chrono::system_clock::now() + timeout);
  if (!affinity_key.empty()) context_.AddMetadata(kAffinityHeader, affinity_key);
  call_ = stub.ProposeStream(&context_);
  reader_ = std::thread(&StreamCall::Read, this);
}

StreamCall::~StreamCall() { Close(); }

std::future<BatchResult> StreamCall::Submit(pb::ProposeBatchRequest req) {
  Pending pending{std::promise<BatchResult>(), {req.state_ids().begin(), req.state_ids().end()}};
  std::future<BatchResult> future = pending.promise.get_future();
  std::lock_guard<std::mutex> write_lock(write_mu_);
  // gRPC allows no write after WritesDone or Finish: say why the stream is over instead.
  if (!writable_) throw DrafterError(Failure());
  {
    std::lock_guard<std::mutex> lock(mu_);
    req.set_request_id(next_id_++);
    pending_.emplace(req.request_id(), std::move(pending));
  }
  // False when the call has ended: the reader then fails the promise with its status.
  call_->Write(req);
  return future;
}

grpc::Status StreamCall::Failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void StreamCall::Read() {
  pb::ProposeBatchResponse resp;
  while (call_->Read(&resp)) {
    std::map<uint64_t, Pending>::node_type answered;
    {
      std::lock_guard<std::mutex> lock(mu_);
      answered = pending_.extract(resp.request_id());
    }
    if (answered.empty()) continue;  // not a request of this stream
    Pending& pending = answered.mapped();
    try {
      if (resp.has_error()) {  // the batch failed as a whole
        throw DrafterError(StatusOf(resp.error()), resp.error().reason(), resp.error().field());
      }
      pending.promise.set_value(BatchResultOf(resp, std::move(pending.state_ids)));
    } catch (...) {  // the error the answer carries, or an answer this client cannot read
      pending.promise.set_exception(std::current_exception());
    }
  }
  // The server has ended the call: no answer will come for what is still pending.
  std::map<uint64_t, Pending> pending;
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
  for (auto& [id, p] : pending) {
    p.promise.set_exception(std::make_exception_ptr(DrafterError(failure)));
  }
}

grpc::Status StreamCall::Close() {
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

void StreamCall::Cancel() { context_.TryCancel(); }

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
