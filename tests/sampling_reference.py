"""Sampled drafts as the service promises them, written again here: vLLM's sampler in
float64, SplitMix64 on Python integers, and the inverse-CDF draw. Imports nothing of
the service.

- q: vLLM's order (vllm/v1/sample/sampler.py: temperature, then the min-p processor, then
  apply_top_k_top_p, which masks on logits sorted ascending: the tokens under the k-th
  largest, then those whose ascending cumulative probability is at most 1 - top_p, the
  last one always kept), then cut to the `support` most probable tokens, renormalised.
- a draw's uniform: SplitMix64 chained over (seed, state, position, draft index), its top
  53 bits; the token: the first of q's support, most probable first, whose cumulative
  probability passes the uniform.
"""

from __future__ import annotations

import math

import pytest
import torch

M64 = (1 << 64) - 1
# fp32 logits are off by about 1e-6 relative: q within 1e-4 of float64's leaves a
# hundredfold margin, while a wrong row, step or parameter moves q by far more.
Q_ATOL = 1e-4


def splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def uniform(seed: int, state: int, position: int, index: int) -> float:
    x = splitmix(seed & M64)
    for word in (state, position, index):
        x = splitmix(x ^ (word & M64))
    return (x >> 11) * 2.0**-53


def vllm_processed(logits, temperature, top_k, top_p, min_p, support) -> torch.Tensor:
    """[V] float64 q, vLLM's order and masks, cut to `support` tokens."""
    x = logits.double() / temperature
    probs = x.softmax(-1)
    x = x.masked_fill(probs < min_p * probs.max(), -math.inf)
    x_sorted, order = x.sort(descending=False)
    if top_k:
        x_sorted = x_sorted.masked_fill(x_sorted < x_sorted[len(x_sorted) - top_k], -math.inf)
    below = x_sorted.softmax(-1).cumsum(-1) <= 1 - top_p
    below[-1] = False
    x_sorted = x_sorted.masked_fill(below, -math.inf)
    q = torch.empty_like(x_sorted).scatter_(0, order, x_sorted).softmax(-1)
    cut = torch.zeros_like(q)
    top = q.topk(min(support, len(q))).indices
    cut[top] = q[top]
    return cut / cut.sum()


def drawn(q: torch.Tensor, u: float, margin: float) -> int | None:
    """The token a uniform `u` draws from dense q [V] (most probable first), or None when
    u lies within `margin` of a cumulative boundary (a q off by that much may draw the
    neighbour)."""
    probs, ids = q.sort(descending=True, stable=True)
    cdf = probs.cumsum(0)
    if (cdf[probs > 0] - u).abs().min() < margin:
        return None
    return int(ids[int((cdf <= u).sum())])


def chi_square_critical(df: int) -> float:
    """The chi-square's 1e-6 upper critical value (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + 4.753 * math.sqrt(2 / (9 * df))) ** 3


def dense_q(proposal, j: int, vocab: int) -> torch.Tensor:
    """Draft j's q as a dense float64 [V]."""
    q = torch.zeros(vocab, dtype=torch.float64)
    ids, probs = torch.tensor(proposal.q_ids[j]), torch.tensor(proposal.q_probs[j])
    return q.index_add_(0, ids, probs.double())


def check_chain(ref, sampling, state: int, tokens, hiddens, proposal, support: int, k: int) -> None:
    """A sampled proposal of `k` drafts against the float64 oracle `ref` after (tokens,
    hiddens), whose last row is the proposed token's: each draft's q within Q_ATOL of the
    oracle's logits processed by `sampling` (its temperature, top_k, top_p, min_p) and cut
    to `support`, its probability q(draft), and the draft the token its key's uniform
    draws from that q (unless the uniform lies within Q_ATOL of a boundary)."""
    tokens, hiddens = list(tokens), hiddens.double()
    assert len(proposal.tokens) == k
    for j, token in enumerate(proposal.tokens):
        out = ref.rows(tokens, hiddens, step=j)[-1]
        logits = ref.logits(out, step=j)
        s = sampling
        want = vllm_processed(logits, s.temperature, s.top_k, s.top_p, s.min_p, support)
        got = dense_q(proposal, j, len(want))
        torch.testing.assert_close(got, want, atol=Q_ATOL, rtol=0)
        assert proposal.probs[j] == pytest.approx(float(got[token]), abs=1e-6)
        u = uniform(s.seed, state, proposal.first_position + j, j)
        expected = drawn(want, u, Q_ATOL)
        assert expected is None or token == expected, f"draft {j}"
        tokens.append(token)
        hiddens = torch.cat([hiddens, out[None]])
