// A verifier's decode loop with the C++ client (the CMake package mtpdraft_client):
//   drafter-example [HOST:PORT]
// It prefills a state with a 4-token prompt, then runs 3 verify steps on one stream, each
// deciding the verdict with mtpdraft::Accept: the drafts are greedy (q one-hot), the target's
// distributions made up, as are the hiddens: a real verifier passes its target's. Then 3 steps
// of a state with sampled drafts, each answer taken by mtpdraft::AcceptBatch.
#include <mtpdraft/drafter_client.h>
#include <mtpdraft/sampling.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const std::string address = argc > 1 ? argv[1] : "localhost:50051";
  try {
    mtpdraft::DrafterClient drafter(address, std::chrono::seconds(30));  // unary calls only
    const mtpdraft::pb::GetInfoResponse info = drafter.GetInfo();
    const int64_t hidden_size = info.hidden_size();
    const size_t vocab = info.vocab_size();
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<double> uniform;
    auto hiddens = [&](int64_t rows) {
      std::vector<float> values(rows * hidden_size);
      for (float& v : values) v = normal(rng);
      return mtpdraft::Tensor::FP32(values, {rows, hidden_size});
    };

    const uint64_t state = drafter.AllocState();
    // Rows (x1, h0) .. (x3, h2) from position 1; x4 is the last prompt token.
    drafter.Prefill(state, 1, {11, 12, 13}, hiddens(3));
    // No deadline: the stream lives as long as the verifier.
    std::unique_ptr<mtpdraft::ProposeStream> stream = drafter.OpenStream();
    mtpdraft::ProposeArgs args;
    args.token = 14, args.hidden = hiddens(1), args.position = 4, args.num_drafts = 3;
    for (int step = 0; step < 3; ++step) {
      const mtpdraft::Proposal p = stream->Propose(state, args);
      std::printf("step %d: drafts", step);
      for (int32_t t : p.tokens) std::printf(" %d", t);
      std::printf(" from position %lld\n", static_cast<long long>(p.first_position));
      // The target's distributions at each draft's position and after the last, made up: each
      // gives about half its mass to the draft. Greedy drafts have q one-hot.
      const size_t k = p.tokens.size();
      std::vector<double> target((k + 1) * vocab), ones(k, 1.0), uniforms(k + 1);
      for (size_t j = 0; j <= k; ++j) {
        double* row = &target[j * vocab];
        double total = 0;
        for (size_t i = 0; i < vocab; ++i) total += row[i] = uniform(rng);
        row[j < k ? p.tokens[j] : 0] += total;
        for (size_t i = 0; i < vocab; ++i) row[i] /= 2 * total;
      }
      for (double& u : uniforms) u = uniform(rng);
      mtpdraft::AcceptArgs verify;
      verify.batch = 1, verify.num_drafts = k, verify.support = 1, verify.vocab = vocab;
      verify.drafts = p.tokens, verify.q_ids = p.tokens, verify.q_probs = ones;
      verify.target_probs = target, verify.uniforms = uniforms;
      const mtpdraft::Accepted verdict = mtpdraft::Accept(verify);
      const int32_t accepted = verdict.num_accepted[0];
      std::printf("step %d: kept %d, next token %d\n", step, accepted, verdict.next_tokens[0]);
      args.previous = mtpdraft::Verdict{accepted};
      args.token = verdict.next_tokens[0];  // the correction or bonus token
      args.hidden = hiddens(1);
      args.position = p.first_position + accepted;
    }
    // Sampled drafts (README.md, "Sampled drafts"): each draft drawn from q, each step's
    // answer taken by AcceptBatch as it is, its verdicts the next step's.
    mtpdraft::StateOptions options;
    options.sampling.emplace();
    options.sampling->set_temperature(0.8f), options.sampling->set_top_k(50);
    options.sampling->set_seed(7);
    const uint64_t sampled = drafter.AllocState(options);
    drafter.Prefill(sampled, 1, {11, 12, 13}, hiddens(3));
    std::vector<uint64_t> ids = {sampled};
    std::vector<int32_t> tokens = {14}, ks = {4}, accepted;
    std::vector<int64_t> positions = {4};
    mtpdraft::Batch batch;
    batch.state_ids = ids, batch.tokens = tokens, batch.positions = positions;
    batch.hiddens = hiddens(1), batch.num_drafts = ks;
    for (int step = 0; step < 3; ++step) {
      const mtpdraft::BatchResult r = stream->Step(batch);  // q in r.q_ids, r.q_probs
      if (r.q_support == 0) throw std::invalid_argument("sampled drafts came without q");
      // Your target's distributions at each draft's position and after the last (here
      // uniform), [B, width + 1, vocab], and uniforms [B, width + 1].
      const std::vector<double> target(r.size() * (r.width + 1) * vocab, 1.0 / vocab);
      std::vector<double> uniforms(r.size() * (r.width + 1));
      for (double& u : uniforms) u = uniform(rng);
      const mtpdraft::Accepted verdict = mtpdraft::AcceptBatch(r, target, vocab, uniforms);
      for (size_t i = 0; i < r.size(); ++i) {
        positions[i] = r.first_positions[i] + verdict.num_accepted[i];
      }
      accepted = verdict.num_accepted, tokens = verdict.next_tokens;
      batch.num_accepted = accepted, batch.tokens = tokens, batch.hiddens = hiddens(1);
      std::printf("sampled step %d: q support %d, kept %d\n", step, r.q_support, accepted[0]);
    }
    drafter.FreeState(sampled);
    stream->Close();
    drafter.FreeState(state);
  } catch (const mtpdraft::DrafterError& e) {
    std::fprintf(stderr, "%s %s: %s\n", e.code_name().c_str(), e.reason().c_str(), e.what());
    return 1;
  } catch (const std::invalid_argument& e) {  // inputs Accept refuses
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  std::printf("cpp example: ok\n");
  return 0;
}
