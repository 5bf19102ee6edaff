"""Speculative sampling end to end on the trained tiny MiMo (examples/tiny_mimo/sampled.py).

Drafts sampled by the engine, verified by the target with the client's ``accept``: the
tokens emitted must follow the target's own sampling distribution. Every emitted token is
ranked under the target's distribution at its position and counted per slot of its
verify step (the j-th token a step emitted: an accepted draft, a correction or the
bonus), against the counts those distributions expect (``rank_chi_square``), at T = 0.7
and 1.0. The same check fails when the verifier is handed a q that is not the drafts'
law (each draft given the next draft's q), and passes with a one-hot q, which is exact
whatever drew the drafts (it only keeps fewer).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from examples.tiny_mimo.sampled import chi_square_critical, rank_chi_square, speculate, trained
from examples.tiny_mimo.verify import find_trained_checkpoint

PROMPT = list(b"import os\nimport sys\n\n\ndef main(")
K = 3


@pytest.fixture(scope="module")
def models():
    if find_trained_checkpoint() is None:
        pytest.skip("the trained tiny MiMo is not here")
    threads = torch.get_num_threads()
    yield trained(K, max_sample_top_k=64)
    torch.set_num_threads(threads)


def run(models, temperature: float, q_given: str | None = None):
    model, engine = models
    rng = np.random.default_rng(int(temperature * 10))
    return speculate(
        model, engine, PROMPT, batch=24, k=K, temperature=temperature, new_tokens=64,
        seed=11, rng=rng, q_given=q_given,
    )  # fmt: skip


def worst_slot(out) -> tuple[float, int]:
    """The largest chi-square over its 1e-6 critical value among the slots with tokens
    enough to test (at least 100), and the slots tested."""
    ratios = []
    for slot in range(K + 1):
        chi2, df, n = rank_chi_square(out, slot)
        if n >= 100 and df >= 1:
            ratios.append(chi2 / chi_square_critical(df))
    return max(ratios), len(ratios)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_emitted_tokens_follow_the_target(models, temperature: float) -> None:
    out = run(models, temperature)
    ratio, slots = worst_slot(out)
    assert slots >= 3 and ratio < 1
    assert np.mean(out.accepted) > 0.5  # the drafts are the trained head's: many kept


def test_a_q_that_is_not_the_drafts_law_fails_the_check(models) -> None:
    ratio, _ = worst_slot(run(models, 1.0, "shifted"))
    assert ratio > 1


def test_a_one_hot_q_stays_exact_and_keeps_fewer(models) -> None:
    out, exact = run(models, 0.7, "one_hot"), run(models, 0.7)
    assert worst_slot(out)[0] < 1
    assert np.mean(out.accepted) < np.mean(exact.accepted)
