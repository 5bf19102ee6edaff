"""Sampled drafts' q and draws (service/model/sampling.py) against references written here.

- q: a float64 reference of vLLM's sampler (vllm/v1/sample/sampler.py: temperature, then
  the min-p processor, then apply_top_k_top_p, which masks on logits sorted ascending: the
  tokens under the k-th largest, then those whose ascending cumulative probability is at
  most 1 - top_p, the last one always kept), then cut to the `support` most probable tokens
  and renormalised.
- the uniforms: SplitMix64 written again on Python integers.
- a draw: tokens drawn over many keys follow q (chi-square).
"""

from __future__ import annotations

import pytest
import torch
from sampling_reference import chi_square_critical, uniform, vllm_processed

from mtpdraft.service.model.sampling import (
    SamplingParams,
    counter_uniforms,
    draw,
    processed_support,
)

CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.3, 5, 1.0, 0.0),
    (0.5, 40, 0.8, 0.05),
    (1.0, 0, 1.0, 0.1),
    (2.0, 3, 0.5, 0.0),
]


@pytest.mark.parametrize("support", [8, 64])
def test_q_is_vllms_processed_distribution_cut_to_its_support(support: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(len(CASES), 1000, generator=gen)
    params = SamplingParams(*(torch.tensor(c) for c in zip(*CASES, strict=True)))
    ids, probs = processed_support(logits, params, support)
    assert ids.shape == probs.shape == (len(CASES), support)
    for row, case in enumerate(CASES):
        want = vllm_processed(logits[row], *case, support)
        got = torch.zeros(1000, dtype=torch.float64).index_add_(0, ids[row], probs[row].double())
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert (probs[row][:-1] >= probs[row][1:]).all()  # the most probable first
        # Alone (a batch whose rows may need no unranked mass, or rank narrower): the same.
        alone = SamplingParams(*(torch.tensor([c]) for c in case))
        ids_1, probs_1 = processed_support(logits[row : row + 1], alone, support)
        got_1 = torch.zeros(1000, dtype=torch.float64).index_add_(0, ids_1[0], probs_1[0].double())
        torch.testing.assert_close(got_1, want, atol=1e-6, rtol=1e-5)


def test_uniforms_are_splitmix64_of_the_key_whatever_the_batch() -> None:
    keys = torch.tensor(
        [[7, 1, 5, 0], [7, 1, 5, 1], [-3, 2**62, 99, 3], [0, 0, 0, 0], [2**63 - 1, 5, 1, 2]]
    )
    together = counter_uniforms(*keys.T)
    for row, key in enumerate(keys.tolist()):
        alone = counter_uniforms(*(torch.tensor([k]) for k in key))
        assert float(alone[0]) == float(together[row]) == uniform(*key)


def test_draws_follow_q() -> None:
    """50,000 keys, one row's q of 6 tokens: a chi-square under its 1e-6 critical value."""
    ids = torch.tensor([[11, 4, 9, 2, 7, 5]])
    probs = torch.tensor([[0.35, 0.25, 0.2, 0.1, 0.07, 0.03]])
    n = 50_000
    u = counter_uniforms(
        torch.full((n,), 42), torch.full((n,), 3), torch.arange(n), torch.zeros(n, dtype=torch.long)
    )
    tokens = draw(ids.expand(n, -1), probs.expand(n, -1), u)
    counts = torch.stack([(tokens == t).sum() for t in ids[0]]).double()
    expected = n * probs[0].double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert counts.sum() == n and chi2 < chi_square_critical(5)
