// The verifier's half of speculative sampling (Leviathan et al. 2023; Chen et al. 2023): which
// drafts to keep, and the token after. The Python client's sampling.accept, token for token
// (tests/conformance/sampling_vector.json); all in double.
//
// Draft j of a row (drawn by the drafter from q_j) is kept if u[j] * q_j(d) < p_j(d), p_j being
// the target's distribution at that position; the drafts kept are those before the first
// refused. At the first refused, the next token is drawn from max(p - q, 0), normalised (from p
// itself where that has no mass); if every draft of the row is kept, the bonus token is drawn
// from p at position count. A token is drawn with u[K] by inverse CDF: the first whose
// normalised cumulative mass exceeds it. The tokens emitted then follow the target's
// distribution whatever q is; greedy drafts are q one-hot (support 1, probability 1).
//
//   mtpdraft::AcceptArgs args;
//   args.batch = b, args.num_drafts = k, args.support = 1, args.vocab = v;
//   args.drafts = drafts, args.q_ids = drafts, args.q_probs = ones;  // greedy drafts
//   args.target_probs = target;  // [B, K + 1, V]: at each draft's position, then after
//   args.uniforms = uniforms;    // [B, K + 1] in [0, 1), e.g. std::uniform_real_distribution
//   mtpdraft::Accepted verdict = mtpdraft::Accept(args);
//   // verdict.num_accepted[i]: the next Propose's previous; verdict.next_tokens[i]: its token
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "mtpdraft/array_view.h"

namespace mtpdraft {

// A batch of B rows of K drafts to judge: row-major arrays, views of the caller's.
struct AcceptArgs {
  size_t batch = 0;       // B
  size_t num_drafts = 0;  // K
  size_t support = 0;     // T: the ids of each draft's q (greedy drafts: 1)
  size_t vocab = 0;       // V
  ArrayView<int32_t> drafts;       // [B, K]; past a row's count: never read
  ArrayView<int32_t> q_ids;        // [B, K, T]: each draft's q, its support
  ArrayView<double> q_probs;       // [B, K, T]: and its probabilities (padding: 0)
  ArrayView<double> target_probs;  // [B, K + 1, V]
  ArrayView<int32_t> counts;       // [B]: drafts per row, 0 to K; empty: K for every row
  ArrayView<double> uniforms;      // [B, K + 1] in [0, 1): one a draft's test, the last for
                                   // the token after
};

// What a verifier does next, per row: keep num_accepted drafts (the verdict the next
// ProposeBatch or Propose carries), then emit next_tokens (the correction or the bonus token).
struct Accepted {
  std::vector<int32_t> num_accepted;
  std::vector<int32_t> next_tokens;
};

// Throws std::invalid_argument, naming the value at fault, on arrays whose sizes do not fit
// the shape, ids outside [0, V), probabilities negative or not finite, uniforms outside
// [0, 1), or a distribution to draw from with no mass.
Accepted Accept(const AcceptArgs& args);

}  // namespace mtpdraft
