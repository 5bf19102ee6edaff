// A verifier's decode loop with the C++ client (the CMake package mtpdraft_client):
//   drafter-example [HOST:PORT]
// It prefills a state with a 4-token prompt, then runs 3 verify steps on one stream, each
// accepting the first draft. Hiddens are random: a real verifier passes its target's.
#include <mtpdraft/drafter_client.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const std::string address = argc > 1 ? argv[1] : "localhost:50051";
  try {
    mtpdraft::DrafterClient drafter(address, std::chrono::seconds(30));  // unary calls only
    const int64_t hidden_size = drafter.GetInfo().hidden_size();
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
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
      const int32_t accepted = p.tokens.empty() ? 0 : 1;  // the target agreed with the first
      args.previous = mtpdraft::Verdict{accepted};
      args.token = 20 + step;  // the bonus token the target sampled
      args.hidden = hiddens(1);
      args.position = p.first_position + accepted;
    }
    stream->Close();
    drafter.FreeState(state);
  } catch (const mtpdraft::DrafterError& e) {
    std::fprintf(stderr, "%s %s: %s\n", e.code_name().c_str(), e.reason().c_str(), e.what());
    return 1;
  }
  std::printf("cpp example: ok\n");
  return 0;
}
