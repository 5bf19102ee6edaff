#include "mtpdraft/sampling.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace mtpdraft {
namespace {

[[noreturn]] void Fail(const std::string& message) {
  throw std::invalid_argument("mtpdraft::Accept: " + message);
}

std::string Index(size_t a, size_t b) {
  return "[" + std::to_string(a) + "][" + std::to_string(b) + "]";
}

// q(d): the probabilities of the support's ids equal to d.
double SupportMass(const int32_t* ids, const double* probs, size_t support, int32_t d) {
  double q = 0;
  for (size_t t = 0; t < support; ++t) {
    if (ids[t] == d) q += probs[t];
  }
  return q;
}

// max(p - q, 0) normalised, or p where that has no mass (p = q: no draft is refused then,
// unless p(draft) = q(draft) = 0).
std::vector<double> Residual(const double* p, const int32_t* ids, const double* probs,
                             size_t support, size_t vocab) {
  std::vector<double> q(vocab, 0.0), r(vocab);
  for (size_t t = 0; t < support; ++t) q[ids[t]] += probs[t];
  double mass = 0;
  for (size_t i = 0; i < vocab; ++i) {
    r[i] = std::max(p[i] - q[i], 0.0);
    mass += r[i];
  }
  if (!(mass > 0)) return std::vector<double>(p, p + vocab);
  for (double& x : r) x /= mass;
  return r;
}

// The first token whose normalised cumulative mass exceeds u (the last if none does); -1
// where dist has no mass.
int32_t InverseCdf(const double* dist, size_t vocab, double u) {
  std::vector<double> cdf(vocab);
  double total = 0;
  for (size_t i = 0; i < vocab; ++i) cdf[i] = total += dist[i];
  if (!(total > 0)) return -1;
  for (size_t i = 0; i < vocab; ++i) {
    if (cdf[i] / total > u) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(vocab - 1);
}

void CheckSize(const char* name, size_t size, size_t want, const char* shape) {
  if (size != want) {
    Fail(std::string(name) + " has " + std::to_string(size) + " values, want " + shape + " = " +
         std::to_string(want));
  }
}

void CheckShapes(const AcceptArgs& a) {
  const size_t b = a.batch, k = a.num_drafts, t = a.support, v = a.vocab;
  if (v == 0) Fail("vocab is 0");
  CheckSize("drafts", a.drafts.size(), b * k, "B * K");
  CheckSize("q_ids", a.q_ids.size(), b * k * t, "B * K * T");
  CheckSize("q_probs", a.q_probs.size(), b * k * t, "B * K * T");
  CheckSize("target_probs", a.target_probs.size(), b * (k + 1) * v, "B * (K + 1) * V");
  CheckSize("uniforms", a.uniforms.size(), b * (k + 1), "B * (K + 1)");
  if (!a.counts.empty()) CheckSize("counts", a.counts.size(), b, "B");
}

// One row's values: the ids it reads (those of its count's drafts) and every probability
// and uniform.
void CheckRow(const AcceptArgs& a, size_t row, size_t count) {
  const size_t k = a.num_drafts, t = a.support, v = a.vocab;
  auto in_vocab = [v](int32_t id) { return id >= 0 && static_cast<size_t>(id) < v; };
  auto probability = [](double p) { return p >= 0 && std::isfinite(p); };
  const std::string vocab = ", not in [0, V = " + std::to_string(v) + ")";
  for (size_t j = 0; j < count; ++j) {
    const int32_t d = a.drafts[row * k + j];
    if (!in_vocab(d)) Fail("drafts" + Index(row, j) + " = " + std::to_string(d) + vocab);
    for (size_t s = 0; s < t; ++s) {
      const int32_t id = a.q_ids[(row * k + j) * t + s];
      if (!in_vocab(id)) {
        Fail("q_ids" + Index(row, j) + "[" + std::to_string(s) + "] = " + std::to_string(id) + vocab);
      }
    }
  }
  for (size_t i = row * k * t; i < (row + 1) * k * t; ++i) {
    if (!probability(a.q_probs[i])) {
      Fail("q_probs" + Index(row, i / t % k) + "[" + std::to_string(i % t) +
           "] = " + std::to_string(a.q_probs[i]) + ", not a probability");
    }
  }
  for (size_t i = row * (k + 1) * v; i < (row + 1) * (k + 1) * v; ++i) {
    if (!probability(a.target_probs[i])) {
      Fail("target_probs" + Index(row, i / v % (k + 1)) + "[" + std::to_string(i % v) +
           "] = " + std::to_string(a.target_probs[i]) + ", not a probability");
    }
  }
  for (size_t j = 0; j <= k; ++j) {
    const double u = a.uniforms[row * (k + 1) + j];
    if (!(u >= 0 && u < 1)) {
      Fail("uniforms" + Index(row, j) + " = " + std::to_string(u) + ", not in [0, 1)");
    }
  }
}

}  // namespace

Accepted Accept(const AcceptArgs& a) {
  CheckShapes(a);
  const size_t k = a.num_drafts, t = a.support, v = a.vocab;
  Accepted out{std::vector<int32_t>(a.batch), std::vector<int32_t>(a.batch)};
  for (size_t row = 0; row < a.batch; ++row) {
    const int32_t count = a.counts.empty() ? static_cast<int32_t>(k) : a.counts[row];
    if (count < 0 || static_cast<size_t>(count) > k) {
      Fail("counts[" + std::to_string(row) + "] = " + std::to_string(count) +
           ", not in [0, K = " + std::to_string(k) + "]");
    }
    CheckRow(a, row, count);
    const double* u = &a.uniforms[row * (k + 1)];
    auto ids = [&](size_t j) { return a.q_ids.data() + (row * k + j) * t; };
    auto probs = [&](size_t j) { return a.q_probs.data() + (row * k + j) * t; };
    auto target = [&](size_t j) { return a.target_probs.data() + (row * (k + 1) + j) * v; };
    size_t kept = 0;
    while (kept < static_cast<size_t>(count)) {
      const int32_t d = a.drafts[row * k + kept];
      const double q = SupportMass(ids(kept), probs(kept), t, d);
      if (!(u[kept] * q < target(kept)[d])) break;
      ++kept;
    }
    std::vector<double> dist(target(kept), target(kept) + v);
    if (kept < static_cast<size_t>(count)) dist = Residual(target(kept), ids(kept), probs(kept), t, v);
    const int32_t token = InverseCdf(dist.data(), v, u[k]);
    if (token < 0) Fail("target_probs" + Index(row, kept) + " has no mass");
    out.num_accepted[row] = static_cast<int32_t>(kept);
    out.next_tokens[row] = token;
  }
  return out;
}

}  // namespace mtpdraft
