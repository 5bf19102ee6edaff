// Sampled drafts, grammar changes and the drafter's own K against an in-process fake Drafter
// (no model): sampling parameters, grammars (none among them) and draft caps on the wire
// (AllocState, Propose, BatchOf's columns), q read back from the answers, and an answer taken
// by AcceptBatch as it is. Exits non-zero on the first failed check.
#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "mtpdraft/drafter_client.h"

namespace pb = mtpdraft::v1;

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::cerr << __FILE__ << ":" << __LINE__ << ": " #cond " failed\n"; \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

// Records each request and answers ProposeBatch with `answer`, Propose with one sampled draft.
class FakeDrafter final : public pb::Drafter::Service {
 public:
  pb::AllocStateRequest alloc;
  pb::ProposeRequest propose;
  pb::ProposeBatchRequest batch;
  pb::ProposeBatchResponse answer;

  grpc::Status AllocState(grpc::ServerContext*, const pb::AllocStateRequest* req,
                          pb::AllocStateResponse* resp) override {
    alloc = *req;
    resp->set_state_id(9);
    return grpc::Status::OK;
  }
  grpc::Status Propose(grpc::ServerContext*, const pb::ProposeRequest* req,
                       pb::Proposal* resp) override {
    propose = *req;
    resp->set_state_id(9);
    resp->add_tokens(3), resp->add_probs(0.75f), resp->set_q_support(2);
    resp->add_q_ids(3), resp->add_q_ids(5), resp->add_q_probs(0.75f), resp->add_q_probs(0.25f);
    return grpc::Status::OK;
  }
  grpc::Status ProposeBatch(grpc::ServerContext*, const pb::ProposeBatchRequest* req,
                            pb::ProposeBatchResponse* resp) override {
    batch = *req;
    *resp = answer;
    return grpc::Status::OK;
  }
};

// The worked example of the Accept tests as an answer's columns: row 0 sampled (two drafts),
// row 1 one draft; q is [B, width, support], zeros past a row's count.
pb::ProposeBatchResponse SampledAnswer() {
  pb::ProposeBatchResponse r;
  r.set_width(2);
  for (int32_t d : {1, 2, 0, -1}) r.add_drafts(d);
  for (float p : {0.5f, 1.0f, 0.6f, 0.0f}) r.add_probs(p);
  for (int32_t n : {2, 1}) r.add_draft_counts(n);
  for (float c : {0.5f, 0.6f}) r.add_confidences(c);
  for (int64_t p : {4, 9}) r.add_first_positions(p);
  r.set_q_support(2);
  for (int32_t id : {1, 0, 2, 0, 0, 1, 0, 0}) r.add_q_ids(id);
  for (float p : {0.5f, 0.5f, 1.0f, 0.0f, 0.6f, 0.4f, 0.0f, 0.0f}) r.add_q_probs(p);
  return r;
}

const std::vector<double> kTarget = {0.5, 0.2, 0.3, 0.3, 0.1, 0.6, 1, 0, 0,
                                     0.7, 0.2, 0.1, 0.1, 0.1, 0.8, 1, 0, 0};

pb::SamplingParams Hot() {
  pb::SamplingParams s;
  s.set_temperature(0.75f), s.set_top_k(4), s.set_seed(7);
  return s;
}

bool Same(const pb::SamplingParams& a, const pb::SamplingParams& b) {
  return a.SerializeAsString() == b.SerializeAsString();
}

void SamplingGoesWithAllocAndPropose(FakeDrafter& fake, mtpdraft::DrafterClient& client) {
  mtpdraft::StateOptions options;
  options.sampling = Hot();
  CHECK(client.AllocState(options) == 9);
  CHECK(fake.alloc.has_sampling() && Same(fake.alloc.sampling(), Hot()));
  client.AllocState();
  CHECK(!fake.alloc.has_sampling() && !fake.alloc.has_grammar());
  mtpdraft::ProposeArgs args;
  args.hidden = mtpdraft::Tensor::FP32(std::vector<float>{0.0f});
  args.num_drafts = 0, args.sampling = Hot(), args.draft_cap = 5, args.verify_token_cost = 0.25f;
  mtpdraft::Proposal p = client.Propose(9, args);
  CHECK(Same(fake.propose.sampling(), Hot()) && fake.propose.num_drafts() == 0);
  CHECK(fake.propose.draft_cap() == 5 && fake.propose.verify_token_cost() == 0.25f);
  CHECK(p.q_support == 2 && p.q_ids == (std::vector<int32_t>{3, 5}));
  CHECK(p.q_probs == (std::vector<float>{0.75f, 0.25f}));
}

void BatchOfMakesTheColumns(FakeDrafter& fake, mtpdraft::DrafterClient& client) {
  std::vector<mtpdraft::BatchRequest> requests(3);
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].state = 3 + i;
    requests[i].args.hidden = mtpdraft::Tensor::FP32(std::vector<float>{0.0f});
  }
  requests[0].args.sampling = Hot();
  requests[1].args.num_drafts = 0, requests[1].args.draft_cap = 3;
  requests[1].args.verify_token_cost = 0.5f;
  requests[2].args.sampling = pb::SamplingParams();
  fake.answer = SampledAnswer();
  mtpdraft::StatesBatch states = mtpdraft::BatchOf(requests);
  try {
    client.ProposeBatch(states.batch());  // three states, an answer of two: refused
    CHECK(false);
  } catch (const mtpdraft::DrafterError&) {
  }
  const pb::ProposeBatchRequest& sent = fake.batch;
  CHECK(sent.sampling_rows_size() == 2 && sent.sampling_rows(0) == 0 && sent.sampling_rows(1) == 2);
  CHECK(sent.sampling_size() == 2 && Same(sent.sampling(0), Hot()));
  CHECK(Same(sent.sampling(1), pb::SamplingParams()));
  CHECK(sent.draft_caps_size() == 3 && sent.draft_caps(1) == 3 && sent.draft_caps(0) == 0);
  CHECK(sent.verify_token_costs_size() == 3 && sent.verify_token_costs(1) == 0.5f);
  requests.resize(1);
  requests[0].args.sampling.reset();
  mtpdraft::StatesBatch plain = mtpdraft::BatchOf(requests);
  CHECK(plain.sampling_rows.empty() && plain.draft_caps.empty() && plain.verify_token_costs.empty());
}

pb::Grammar Regex(const std::string& regex) {
  pb::Grammar g;
  g.set_regex(regex);
  return g;
}

pb::Grammar NoGrammar() {
  pb::Grammar g;
  g.set_none(true);
  return g;
}

// A propose's grammar goes in its request (none as none, unset as absent); BatchOf makes the
// grammar columns of the rows that change grammar, in order.
void GrammarGoesWithProposeAndBatch(FakeDrafter& fake, mtpdraft::DrafterClient& client) {
  mtpdraft::ProposeArgs args;
  args.hidden = mtpdraft::Tensor::FP32(std::vector<float>{0.0f});
  args.grammar = Regex("[0-3]{4}");
  client.Propose(9, args);
  CHECK(fake.propose.has_grammar() && fake.propose.grammar().regex() == "[0-3]{4}");
  args.grammar = NoGrammar();
  client.Propose(9, args);
  CHECK(fake.propose.grammar().kind_case() == pb::Grammar::kNone && fake.propose.grammar().none());
  args.grammar.reset();
  client.Propose(9, args);
  CHECK(!fake.propose.has_grammar());

  std::vector<mtpdraft::BatchRequest> requests(3);
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].state = 3 + i;
    requests[i].args.hidden = mtpdraft::Tensor::FP32(std::vector<float>{0.0f});
  }
  requests[0].args.grammar = NoGrammar();
  requests[2].args.grammar = Regex("[0-3]{4}");
  fake.answer = SampledAnswer();
  mtpdraft::StatesBatch states = mtpdraft::BatchOf(requests);
  CHECK(states.grammar_rows == (std::vector<int32_t>{0, 2}));
  try {
    client.ProposeBatch(states.batch());  // three states, an answer of two: refused
    CHECK(false);
  } catch (const mtpdraft::DrafterError&) {
  }
  const pb::ProposeBatchRequest& sent = fake.batch;
  CHECK(sent.grammar_rows_size() == 2 && sent.grammar_rows(0) == 0 && sent.grammar_rows(1) == 2);
  CHECK(sent.grammars_size() == 2 && sent.grammars(0).none());
  CHECK(sent.grammars(1).regex() == "[0-3]{4}");
  requests.resize(1);
  requests[0].args.grammar.reset();
  mtpdraft::StatesBatch plain = mtpdraft::BatchOf(requests);
  CHECK(plain.grammar_rows.empty() && plain.grammars.empty());
}

void AnswersCarryQIntoAcceptBatch(FakeDrafter& fake, mtpdraft::DrafterClient& client) {
  std::vector<mtpdraft::BatchRequest> requests(2);
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].state = 3 + i;
    requests[i].args.hidden = mtpdraft::Tensor::FP32(std::vector<float>{0.0f});
  }
  fake.answer = SampledAnswer();
  mtpdraft::StatesBatch states = mtpdraft::BatchOf(requests);
  mtpdraft::BatchResult r = client.ProposeBatch(states.batch());
  CHECK(r.q_support == 2 && r.q_ids.size() == 8);
  mtpdraft::Proposal row1 = r.RowProposal(1);
  CHECK(row1.q_ids == (std::vector<int32_t>{0, 1}));
  CHECK(row1.q_probs == (std::vector<float>{0.6f, 0.4f}));
  // Row 0 keeps 1 and draws 1, row 1 keeps 1 and draws 0 (the worked example).
  std::vector<double> u = {0.3, 0.7, 0.8, 0.9, 0, 0.05};
  mtpdraft::Accepted v = mtpdraft::AcceptBatch(r, kTarget, 3, u);
  CHECK(v.num_accepted == (std::vector<int32_t>{1, 1}) && v.next_tokens == (std::vector<int32_t>{1, 0}));
  // Without q each draft is its own at 1: row 0 keeps draft 1 (p 0.2 > u 0.1) and refuses
  // draft 2 (p 0.6 < 0.7), then draws 1 from (0.3, 0.1, 0) / 0.4 at 0.8; row 1 refuses its
  // draft (p 0.7 < 0.9), then draws 1 from (0, 0.2, 0.1) / 0.3 at 0.5.
  r.q_support = 0, r.q_ids.clear(), r.q_probs.clear();
  u = {0.1, 0.7, 0.8, 0.9, 0, 0.5};
  v = mtpdraft::AcceptBatch(r, kTarget, 3, u);
  CHECK(v.num_accepted == (std::vector<int32_t>{1, 0}) && v.next_tokens == (std::vector<int32_t>{1, 1}));
  // An answer whose q does not fill [B, width, support] is refused.
  fake.answer.mutable_q_probs()->RemoveLast();
  try {
    client.ProposeBatch(states.batch());
    CHECK(false);
  } catch (const mtpdraft::DrafterError&) {
  }
}

int main() {
  FakeDrafter fake;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&fake);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  CHECK(server != nullptr && port > 0);
  mtpdraft::DrafterClient client("127.0.0.1:" + std::to_string(port));
  SamplingGoesWithAllocAndPropose(fake, client);
  BatchOfMakesTheColumns(fake, client);
  GrammarGoesWithProposeAndBatch(fake, client);
  AnswersCarryQIntoAcceptBatch(fake, client);
  server->Shutdown();
  std::cout << "client tests: ok\n";
  return 0;
}
