// Replays the conformance vector (tests/conformance/vector.json) against a live server:
//   mtpdraft-conformance --address 127.0.0.1:50051 [--vector PATH]
// A ProposeBatch sends one ProposeBatchRequest of its columns ("states" names the rows'
// states); a ProposeStream sends its messages (batches too) on one stream, one at a time.
// One line per operation, then "cpp: N passed, M failed"; exits 1 on any failure, 2 on a
// vector no runner may replay (checked before any call). Then one more line: a stream has no
// deadline unless it asks for one (StreamDeadlines).
#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mtpdraft/drafter_client.h"

using nlohmann::json;

namespace {

std::string Base64Decode(const std::string& in) {
  static const std::string kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t buffer = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    size_t v = kAlphabet.find(c);
    if (v == std::string::npos) throw std::runtime_error("bad base64");
    buffer = (buffer << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((buffer >> bits) & 0xff));
    }
  }
  return out;
}

std::optional<mtpdraft::Tensor> TensorOf(const json& op, const char* key) {
  if (!op.contains(key) || op[key].is_null()) return std::nullopt;
  const json& t = op[key];
  mtpdraft::pb::DType dtype;
  if (!mtpdraft::pb::DType_Parse(t.at("dtype").get<std::string>(), &dtype)) {
    throw std::runtime_error("unknown dtype " + t.at("dtype").dump());
  }
  return mtpdraft::Tensor{dtype, t.at("shape").get<std::vector<int64_t>>(),
                          Base64Decode(t.at("data").get<std::string>())};
}

// A GetInfoResponse field by its proto name (enums by name) as JSON.
// An error as every runner prints it: "CODE (reason R, field F)".
std::string ErrorText(const std::string& code, const std::string& reason,
                      const std::string& field) {
  return code + " (reason " + reason + ", field " + field + ")";
}

json InfoField(const google::protobuf::Message& m, const std::string& name) {
  using google::protobuf::FieldDescriptor;
  const FieldDescriptor* fd = m.GetDescriptor()->FindFieldByName(name);
  if (fd == nullptr) return nullptr;
  const google::protobuf::Reflection* r = m.GetReflection();
  if (fd->is_repeated()) {
    json out = json::array();
    for (int i = 0; i < r->FieldSize(m, fd); ++i) {
      if (fd->cpp_type() == FieldDescriptor::CPPTYPE_ENUM) {
        out.push_back(r->GetRepeatedEnum(m, fd, i)->name());
      } else {
        throw std::runtime_error("unsupported repeated field " + name);
      }
    }
    return out;
  }
  switch (fd->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: return r->GetInt32(m, fd);
    case FieldDescriptor::CPPTYPE_INT64: return r->GetInt64(m, fd);
    case FieldDescriptor::CPPTYPE_UINT32: return r->GetUInt32(m, fd);
    case FieldDescriptor::CPPTYPE_UINT64: return r->GetUInt64(m, fd);
    case FieldDescriptor::CPPTYPE_DOUBLE: return r->GetDouble(m, fd);
    case FieldDescriptor::CPPTYPE_FLOAT: return r->GetFloat(m, fd);
    case FieldDescriptor::CPPTYPE_BOOL: return r->GetBool(m, fd);
    case FieldDescriptor::CPPTYPE_STRING: return r->GetString(m, fd);
    case FieldDescriptor::CPPTYPE_ENUM: return r->GetEnum(m, fd)->name();
    default: throw std::runtime_error("unsupported field " + name);
  }
}

// Keys whose numbers compare within the vector's prob_tolerance (at any depth).
bool Tolerant(const std::string& key) {
  return key == "probs" || key == "confidence" || key == "confidences" || key == "q_probs";
}

// Whether `got` is what the vector expects under `key`: objects by the expected keys, arrays
// element by element, the tolerant keys' numbers within `tol`, a batch's errors
// exactly (an entry without reason or field expects none), all else exactly.
bool Same(const std::string& key, const json& want, const json& got, double tol) {
  if (key == "errors" && want.is_array()) {
    json w = want;
    for (json& e : w) {
      if (!e.is_object()) continue;
      if (!e.contains("reason")) e["reason"] = "";
      if (!e.contains("field")) e["field"] = "";
    }
    return w == got;
  }
  if (want.is_object()) {
    if (!got.is_object()) return false;
    for (const auto& [k, w] : want.items()) {
      if (!Same(k, w, got.contains(k) ? got[k] : json(nullptr), tol)) return false;
    }
    return true;
  }
  if (want.is_array()) {
    if (!got.is_array() || got.size() != want.size()) return false;
    for (size_t i = 0; i < want.size(); ++i) {
      if (!Same(key, want[i], got[i], tol)) return false;
    }
    return true;
  }
  if (Tolerant(key) && want.is_number()) {
    return got.is_number() && std::isfinite(got.get<double>()) &&
           std::fabs(got.get<double>() - want.get<double>()) <= tol;
  }
  return want == got;
}

// The fields of `expected` that `actual` does not match; with one_of (the answers a sampled
// draft may give), none where `actual` matches one of them.
std::vector<std::string> Mismatches(const json& expected, const json& actual, double tol) {
  if (expected.contains("one_of")) {
    std::vector<std::string> first;
    for (const json& answer : expected["one_of"]) {
      std::vector<std::string> bad = Mismatches(answer, actual, tol);
      if (bad.empty()) return {};
      if (first.empty()) first = bad;
    }
    std::string text = "none of " + std::to_string(expected["one_of"].size()) + " answers:";
    for (const std::string& b : first) text += " " + b + ";";
    return {text};
  }
  std::vector<std::string> out;
  for (const auto& [key, want] : expected.items()) {
    json got = actual.contains(key) ? actual[key] : json(nullptr);
    if (!Same(key, want, got, tol)) {
      out.push_back(key + ": expected " + want.dump() + ", got " + got.dump());
    }
  }
  return out;
}

// A column of a batch: its values, one value as a list of one, or none (an absent key).
template <typename T>
std::vector<T> ColumnOf(const json& op, const char* key) {
  if (!op.contains(key) || op[key].is_null()) return {};
  if (op[key].is_array()) return op[key].get<std::vector<T>>();
  return {op[key].get<T>()};
}

// A batch's columns and the arrays their views read.
struct BatchArgs {
  std::vector<uint64_t> state_ids;
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;
  std::vector<int32_t> num_drafts;
  std::vector<int32_t> num_accepted;
  std::vector<int32_t> refeed_rows;
  std::vector<int32_t> bitmask_rows;
  std::vector<float> min_confidence;
  std::vector<int32_t> sampling_rows;
  std::vector<mtpdraft::pb::SamplingParams> sampling;
  std::vector<int32_t> grammar_rows;
  std::vector<mtpdraft::pb::Grammar> grammars;
  std::vector<int32_t> draft_caps;
  std::vector<float> verify_token_costs;
  mtpdraft::Batch step;
};

// A SamplingParams as the vector writes it (absent fields: 0).
mtpdraft::pb::SamplingParams SamplingOf(const json& s) {
  mtpdraft::pb::SamplingParams out;
  out.set_temperature(s.value("temperature", 0.0f));
  out.set_top_k(s.value("top_k", 0));
  out.set_top_p(s.value("top_p", 0.0f));
  out.set_min_p(s.value("min_p", 0.0f));
  out.set_seed(s.value("seed", uint64_t{0}));
  return out;
}

// Rows of `n` values of a flat column (none when n is 0).
template <typename T>
json RowsOf(const std::vector<T>& flat, size_t n) {
  json out = json::array();
  for (size_t lo = 0; n > 0 && lo + n <= flat.size(); lo += n) {
    out.push_back(std::vector<T>(flat.begin() + lo, flat.begin() + lo + n));
  }
  return out;
}

// Groups of `n` items of a json array.
json GroupsOf(const json& items, size_t n) {
  json out = json::array();
  for (size_t lo = 0; n > 0 && lo + n <= items.size(); lo += n) {
    out.push_back(json(std::vector<json>(items.begin() + lo, items.begin() + lo + n)));
  }
  return out;
}

class Replayer {
 public:
  Replayer(mtpdraft::DrafterClient& client, double tol) : client_(client), tol_(tol) {}

  // The operation's outputs, named as in the vector.
  json Call(const json& op) {
    const std::string name = op.at("op");
    if (name == "GetInfo") {
      mtpdraft::pb::GetInfoResponse info = client_.GetInfo();
      json out = json::object();
      if (op.contains("expect")) {
        for (const auto& item : op["expect"].items()) out[item.key()] = InfoField(info, item.key());
      }
      return out;
    }
    if (name == "AllocState") {
      mtpdraft::StateOptions options;
      const mtpdraft::pb::Grammar grammar = GrammarOf(op);
      if (grammar.kind_case() != mtpdraft::pb::Grammar::KIND_NOT_SET) options.grammar = grammar;
      if (op.contains("sampling")) options.sampling = SamplingOf(op["sampling"]);
      states_[op.at("state")] = NonZero(client_.AllocState(options), "AllocState");
      return json::object();
    }
    if (name == "ProposeBatch") {
      BatchArgs args;
      BatchOf(op, &args);
      return BatchJson(client_.ProposeBatch(args.step));
    }
    const uint64_t state = states_[op.at("state")];
    if (name == "Prefill") {
      auto r = client_.Prefill(state, op.at("start_position"), op.at("tokens"),
                               *TensorOf(op, "hiddens"), op.at("chunk_rows"));
      return {{"num_rows", r.num_rows}, {"next_position", r.next_position}, {"chunks", r.chunks}};
    }
    if (name == "Propose") return ProposalJson(client_.Propose(state, ProposeArgsOf(op)), state);
    if (name == "AfterVerify") {
      auto r = client_.AfterVerify(state, op.at("num_accepted"), TensorOf(op, "refeed_hiddens"));
      return {{"num_rows", r.num_rows}, {"next_position", r.next_position}};
    }
    if (name == "TakeKV") {
      mtpdraft::KVHandle h = client_.TakeKV(state);
      handles_[op.at("handle")] = NonZero(h.handle_id, "TakeKV");
      return {{"num_rows", h.num_rows}};
    }
    if (name == "InstallKV") {
      auto r = client_.InstallKV(state, handles_[op.at("handle")]);
      return {{"num_rows", r.num_rows}, {"next_position", r.next_position}};
    }
    if (name == "FreeState") return {{"existed", client_.FreeState(state)}};
    throw std::runtime_error("unknown operation " + name);
  }

  // Whether the operation did what the vector expects, and a message.
  std::pair<bool, std::string> Step(const json& op) {
    if (op.at("op") == "ProposeStream") return StreamStep(op);
    return Judge(op, [&] { return Call(op); });
  }

  // One stream, its messages (batches: ProposeBatch operations without "op") sent one at a
  // time, each answered before the next; ok when every answer is as expected. Closing it must
  // end the call cleanly.
  std::pair<bool, std::string> StreamStep(const json& op) {
    std::unique_ptr<mtpdraft::ProposeStream> stream;
    try {
      stream = client_.OpenStream();
    } catch (const std::exception& e) {
      return {false, std::string("error: ") + e.what()};
    }
    bool ok = true;
    std::string lines;
    const json& messages = op.at("messages");
    for (size_t j = 0; j < messages.size(); ++j) {
      const json& msg = messages[j];
      auto [good, text] = Judge(msg, [&] {
        BatchArgs args;
        BatchOf(msg, &args);
        return BatchJson(stream->Step(args.step));
      });
      ok = ok && good;
      lines += (j == 0 ? "[" : "; [") + std::to_string(j) + "] " + text;
    }
    const grpc::Status status = stream->Close();
    if (!status.ok()) {
      const mtpdraft::DrafterError e(status);
      return {false, lines + "; the stream ended with " +
                         ErrorText(e.code_name(), e.reason(), e.field()) + ": " + e.what()};
    }
    return {ok, lines};
  }

  // Runs `call` and compares its outputs (or its error) with what `op` expects.
  std::pair<bool, std::string> Judge(const json& op, const std::function<json()>& call) {
    const std::string want_error = op.value("expect_error", "");
    json actual;
    try {
      actual = call();
    } catch (const mtpdraft::DrafterError& e) {
      const std::string got = ErrorText(e.code_name(), e.reason(), e.field());
      const std::string want =
          want_error.empty()
              ? "success"
              : ErrorText(want_error, op.value("expect_reason", ""), op.value("expect_field", ""));
      if (got == want) return {true, got + " as expected"};
      return {false, "expected " + want + ", got " + got + ": " + e.what()};
    } catch (const std::exception& e) {
      return {false, std::string("error: ") + e.what()};
    }
    if (!want_error.empty()) return {false, "expected " + want_error + ", got " + actual.dump()};
    auto bad = Mismatches(op.value("expect", json::object()), actual, tol_);
    if (bad.empty()) return {true, actual.dump()};
    std::string msg;
    for (const auto& b : bad) msg += (msg.empty() ? "" : "; ") + b;
    return {false, msg};
  }

  void FreeAll() {
    for (const auto& [name, state] : states_) {
      try {
        client_.FreeState(state);
      } catch (const std::exception&) {
      }
    }
  }

 private:
  // The client's arguments for a Propose operation.
  static mtpdraft::ProposeArgs ProposeArgsOf(const json& op) {
    mtpdraft::ProposeArgs args;
    args.token = op.at("token");
    args.hidden = *TensorOf(op, "hidden");
    args.position = op.at("position");
    args.num_drafts = op.at("num_drafts");
    args.bitmask = TensorOf(op, "bitmask");
    args.min_confidence = op.value("min_confidence", 0.0f);
    if (op.contains("previous")) {
      const json& prev = op["previous"];
      args.previous = mtpdraft::Verdict{prev.at("num_accepted"), TensorOf(prev, "refeed_hiddens")};
    }
    if (op.contains("sampling")) args.sampling = SamplingOf(op["sampling"]);
    if (op.contains("grammar")) args.grammar = GrammarOf(op);
    args.draft_cap = op.value("draft_cap", 0);
    args.verify_token_cost = op.value("verify_token_cost", 0.0f);
    return args;
  }

  // An operation's grammar (none given: a Grammar with no kind set).
  static mtpdraft::pb::Grammar GrammarOf(const json& op) {
    if (!op.contains("grammar")) return mtpdraft::pb::Grammar();
    return GrammarFrom(op.at("grammar"));
  }

  // A grammar of the vector: its one kind and source, or {"none": true}.
  static mtpdraft::pb::Grammar GrammarFrom(const json& kinds) {
    mtpdraft::pb::Grammar grammar;
    if (kinds.size() != 1) throw std::runtime_error("a grammar of more than one kind");
    const std::string& kind = kinds.begin().key();
    if (kind == "none") {
      if (kinds.begin().value() != true) throw std::runtime_error("grammar none is not true");
      grammar.set_none(true);
      return grammar;
    }
    const std::string source = kinds.begin().value().get<std::string>();
    if (kind == "json_schema") {
      grammar.set_json_schema(source);
    } else if (kind == "ebnf") {
      grammar.set_ebnf(source);
    } else if (kind == "regex") {
      grammar.set_regex(source);
    } else if (kind == "structural_tag") {
      grammar.set_structural_tag(source);
    } else {
      throw std::runtime_error("unknown grammar kind " + kind);
    }
    return grammar;
  }

  // A batch's columns into `out` (state names bound by AllocState).
  void BatchOf(const json& op, BatchArgs* out) {
    for (const json& name : op.at("states")) out->state_ids.push_back(states_[name]);
    out->tokens = ColumnOf<int32_t>(op, "tokens");
    out->positions = ColumnOf<int64_t>(op, "positions");
    out->num_drafts = ColumnOf<int32_t>(op, "num_drafts");
    out->num_accepted = ColumnOf<int32_t>(op, "num_accepted");
    out->refeed_rows = ColumnOf<int32_t>(op, "refeed_rows");
    out->bitmask_rows = ColumnOf<int32_t>(op, "bitmask_rows");
    out->min_confidence = ColumnOf<float>(op, "min_confidence");
    out->sampling_rows = ColumnOf<int32_t>(op, "sampling_rows");
    if (op.contains("sampling")) {
      for (const json& s : op["sampling"]) out->sampling.push_back(SamplingOf(s));
    }
    out->grammar_rows = ColumnOf<int32_t>(op, "grammar_rows");
    if (op.contains("grammars")) {
      for (const json& g : op["grammars"]) out->grammars.push_back(GrammarFrom(g));
    }
    out->draft_caps = ColumnOf<int32_t>(op, "draft_caps");
    out->verify_token_costs = ColumnOf<float>(op, "verify_token_costs");
    mtpdraft::Batch& step = out->step;
    step.state_ids = out->state_ids;
    step.tokens = out->tokens;
    step.positions = out->positions;
    step.hiddens = TensorOf(op, "hiddens").value_or(mtpdraft::Tensor());
    step.num_drafts = out->num_drafts;
    step.num_accepted = out->num_accepted;
    step.refeed_rows = out->refeed_rows;
    step.refeed_hiddens = TensorOf(op, "refeed_hiddens");
    step.bitmask_rows = out->bitmask_rows;
    step.bitmasks = TensorOf(op, "bitmasks");
    step.min_confidence = out->min_confidence;
    step.sampling_rows = out->sampling_rows;
    step.sampling = out->sampling;
    step.grammar_rows = out->grammar_rows;
    step.grammars = out->grammars;
    step.draft_caps = out->draft_caps;
    step.verify_token_costs = out->verify_token_costs;
  }

  // A batch's answer's outputs, named as in the vector: [B, width] drafts and probs as B
  // rows, and the failed rows' errors in row order.
  static json BatchJson(const mtpdraft::BatchResult& r) {
    json drafts = json::array(), probs = json::array(), errors = json::array();
    for (size_t i = 0; i < r.size(); ++i) {
      const size_t lo = i * r.width, hi = lo + r.width;
      drafts.push_back(std::vector<int32_t>(r.drafts.begin() + lo, r.drafts.begin() + hi));
      probs.push_back(std::vector<float>(r.probs.begin() + lo, r.probs.begin() + hi));
    }
    for (const auto& [row, e] : r.errors) {
      errors.push_back(
          {{"row", row}, {"code", e.code_name()}, {"reason", e.reason()}, {"field", e.field()}});
    }
    return {{"width", r.width},
            {"drafts", drafts},
            {"probs", probs},
            {"draft_counts", r.counts},
            {"confidences", r.confidences},
            {"first_positions", r.first_positions},
            {"errors", errors},
            {"q_support", r.q_support},
            {"q_ids", GroupsOf(RowsOf(r.q_ids, r.q_support), r.width)},
            {"q_probs", GroupsOf(RowsOf(r.q_probs, r.q_support), r.width)}};
  }

  // A Proposal's outputs, named as in the vector; it must be the state's.
  static json ProposalJson(const mtpdraft::Proposal& p, uint64_t state) {
    if (p.state_id != state) throw std::runtime_error("Proposal.state_id differs from the state");
    return {{"tokens", p.tokens},
            {"probs", p.probs},
            {"confidence", p.confidence},
            {"first_position", p.first_position},
            {"q_support", p.q_support},
            {"q_ids", RowsOf(p.q_ids, p.q_support)},
            {"q_probs", RowsOf(p.q_probs, p.q_support)}};
  }

  static uint64_t NonZero(uint64_t id, const char* what) {
    if (id == 0) throw std::runtime_error(std::string(what) + " returned id 0");
    return id;
  }

  mtpdraft::DrafterClient& client_;
  double tol_;
  std::map<std::string, uint64_t> states_;
  std::map<std::string, uint64_t> handles_;
};

// Whether the operation's `key` is a list with some entries.
bool NonEmptyList(const json& op, const char* key) {
  return op.contains(key) && op[key].is_array() && !op[key].empty();
}

// Why no runner may replay the vector, or "" if one may.
std::string VectorFault(const json& v) {
  static const std::string kFormat = "mtpdraft-conformance/4";
  static const std::set<std::string> kOps = {
      "GetInfo",     "AllocState", "Prefill",   "Propose",  "ProposeBatch",
      "ProposeStream", "AfterVerify", "TakeKV", "InstallKV", "FreeState"};
  if (!v.is_object()) return "the vector is not a JSON object";
  if (!v.contains("format") || v["format"] != kFormat) {
    return "format is " + (v.contains("format") ? v["format"].dump() : "missing") + ", not \"" +
           kFormat + "\"";
  }
  if (!v.contains("prob_tolerance") || !v["prob_tolerance"].is_number() ||
      !(v["prob_tolerance"].get<double>() >= 0) || std::isinf(v["prob_tolerance"].get<double>())) {
    return "prob_tolerance is missing or not a non-negative number";
  }
  if (!v.contains("operations") || !v["operations"].is_array() || v["operations"].empty()) {
    return "operations is missing or empty";
  }
  for (size_t i = 0; i < v["operations"].size(); ++i) {
    const json& op = v["operations"][i];
    const json name = op.is_object() && op.contains("op") ? op["op"] : json(nullptr);
    if (!name.is_string() || kOps.count(name.get<std::string>()) == 0) {
      return "operation " + std::to_string(i) + ": unknown op " + name.dump();
    }
    const std::string at = "operation " + std::to_string(i) + ": ";
    if (name == "ProposeStream" && !NonEmptyList(op, "messages")) {
      return at + "ProposeStream without messages";
    }
    std::vector<json> batches;
    if (name == "ProposeBatch") batches.push_back(op);
    if (name == "ProposeStream") batches.assign(op["messages"].begin(), op["messages"].end());
    for (const json& batch : batches) {
      const std::string kind = "a " + name.get<std::string>() + " batch";
      if (!batch.is_object() || !NonEmptyList(batch, "states")) return at + kind + " without states";
      if (!batch.contains("hiddens") || !batch["hiddens"].is_object()) {
        return at + kind + " without hiddens";
      }
    }
  }
  return "";
}

// The number of entries of a list of the operation, "?" where it has none.
std::string CountOf(const json& op, const char* key) {
  return op.contains(key) && op[key].is_array() ? std::to_string(op[key].size()) : "?";
}

// An operation's name in its line: the op and its state, a stream's message count or a
// batch's state count.
std::string Label(const json& op) {
  std::string label = op.at("op").get<std::string>();
  if (label == "ProposeStream") return label + " (" + CountOf(op, "messages") + " messages)";
  if (label == "ProposeBatch") return label + " (" + CountOf(op, "states") + " states)";
  if (op.contains("state") && op["state"].is_string()) label += " " + op["state"].get<std::string>();
  return label;
}

// A client whose calls time out after 300 ms keeps a stream open past that: the stream
// still answers (a Propose for a state that does not exist: NOT_FOUND, from the server). A
// stream opened with its own 300 ms timeout has ended by then (DEADLINE_EXCEEDED).
std::pair<bool, std::string> StreamDeadlines(const std::string& address) {
  using std::chrono::milliseconds;
  const milliseconds timeout(300), past(800);
  mtpdraft::DrafterClient quick(address, timeout);
  mtpdraft::ProposeArgs args;
  try {
    args.hidden = mtpdraft::Tensor::FP32(std::vector<float>(quick.GetInfo().hidden_size(), 0.5f));
  } catch (const std::exception& e) {
    return {false, std::string("GetInfo: ") + e.what()};
  }
  args.token = 1, args.position = 1, args.num_drafts = 1;
  const uint64_t unknown = (uint64_t{1} << 63) + 12345;
  auto outcome = [&](mtpdraft::ProposeStream& stream) -> std::string {
    try {
      stream.Propose(unknown, args);
      return "OK";
    } catch (const mtpdraft::DrafterError& e) {
      return e.code_name();
    }
  };
  std::unique_ptr<mtpdraft::ProposeStream> open = quick.OpenStream();
  std::unique_ptr<mtpdraft::ProposeStream> bounded = quick.OpenStream(timeout);
  std::this_thread::sleep_for(past);
  const std::string kept = outcome(*open), expired = outcome(*bounded);
  open->Close();
  bounded->Close();
  const std::string text = "a stream without a timeout answered " + kept +
                           " past the client's timeout, one with a timeout " + expired;
  return {kept == "NOT_FOUND" && expired == "DEADLINE_EXCEEDED", text};
}

}  // namespace

int main(int argc, char** argv) {
  const char* env = std::getenv("MTPDRAFT_CONFORMANCE_ADDRESS");
  std::string address = env ? env : "";
  std::string path = "tests/conformance/vector.json";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--address" && i + 1 < argc) {
      address = argv[++i];
    } else if (arg == "--vector" && i + 1 < argc) {
      path = argv[++i];
    } else {
      std::cerr << "usage: mtpdraft-conformance --address HOST:PORT [--vector PATH]\n";
      return 2;
    }
  }
  if (address.empty()) {
    std::cerr << "usage: mtpdraft-conformance --address HOST:PORT [--vector PATH]\n";
    return 2;
  }
  json vector;
  try {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open " + path);
    vector = json::parse(in);
  } catch (const std::exception& e) {
    std::cerr << "cpp: bad vector: " << e.what() << "\n";
    return 2;
  }
  if (const std::string fault = VectorFault(vector); !fault.empty()) {
    std::cerr << "cpp: bad vector: " << fault << "\n";
    return 2;
  }
  mtpdraft::DrafterClient client(address);
  Replayer replayer(client, vector.at("prob_tolerance").get<double>());
  int passed = 0, failed = 0, index = 0;
  for (const json& op : vector.at("operations")) {
    auto [ok, message] = replayer.Step(op);
    ok ? ++passed : ++failed;
    std::printf("%s %02d %s: %s\n", ok ? "ok  " : "FAIL", index++, Label(op).c_str(),
                message.c_str());
  }
  replayer.FreeAll();
  std::printf("cpp: %d passed, %d failed\n", passed, failed);
  const auto [deadlines_ok, deadlines] = StreamDeadlines(address);
  std::printf("%s stream deadlines: %s\n", deadlines_ok ? "ok  " : "FAIL", deadlines.c_str());
  return failed == 0 && passed == static_cast<int>(vector.at("operations").size()) && deadlines_ok
             ? 0
             : 1;
}
