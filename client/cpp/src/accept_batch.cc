// AcceptBatch: a batch's answer in Accept's layout.
#include <vector>

#include "mtpdraft/drafter_client.h"

namespace mtpdraft {

Accepted AcceptBatch(const BatchResult& r, ArrayView<double> target_probs, size_t vocab,
                     ArrayView<double> uniforms) {
  // Greedy answers carry no q: each draft is its own, at probability 1.
  const bool greedy = r.q_support == 0;
  std::vector<double> q_probs(greedy ? r.drafts.size() : r.q_probs.size(), 1.0);
  if (!greedy) q_probs.assign(r.q_probs.begin(), r.q_probs.end());
  AcceptArgs args;
  args.batch = r.size(), args.num_drafts = static_cast<size_t>(r.width);
  args.support = greedy ? 1 : static_cast<size_t>(r.q_support), args.vocab = vocab;
  args.drafts = r.drafts, args.q_ids = greedy ? r.drafts : r.q_ids, args.q_probs = q_probs;
  args.target_probs = target_probs, args.counts = r.counts, args.uniforms = uniforms;
  return Accept(args);
}

}  // namespace mtpdraft
