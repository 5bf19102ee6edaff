"""The verifier's rejection sampler (mtpdraft.client.sampling.accept): exact, and only so
with the drafts' true q.

The target and the drafter are two Markov chains over a small vocabulary (the next token's
distribution depends on the last token), so that the exact answer is known: a verifier
that drafts K tokens from q, accepts with `accept` and goes on from what it emitted must
emit sequences whose law is the target chain's. Checked by a chi-square test over the
first two tokens emitted (V * V cells), for numpy and torch, greedy and sampled drafts,
against a critical value no exact sampler exceeds but once in a million runs
(Wilson-Hilferty's approximation of the chi-square quantile). The same test with a q that
is not the drafts' law (greedy drafts handed over with the drafter's q, as if drawn from
it) must fail it. (One-hot q is exact whatever chose the drafts: it only keeps fewer.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mtpdraft.client.sampling import accept

V, K, N = 5, 3, 40_000
Z_ONE_IN_A_MILLION = 4.753


def chi_square_critical(df: int, z: float = Z_ONE_IN_A_MILLION) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chain(seed: int, peaked: float) -> np.ndarray:
    """[V, V]: row t is the next token's distribution after t."""
    logits = np.random.default_rng(seed).standard_normal((V, V)) * peaked
    p = np.exp(logits)
    return p / p.sum(-1, keepdims=True)


TARGET, DRAFTER = _chain(1, 1.5), _chain(2, 1.0)


def _top(q: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-t support of each row of q, renormalised (the drafter's sparse q)."""
    ids = np.argsort(-q, axis=-1)[..., :t]
    probs = np.take_along_axis(q, ids, -1)
    return ids, probs / probs.sum(-1, keepdims=True)


def _first_two(rng: np.random.Generator, support: int, honest: bool, as_torch: bool):
    """N sequences from x0 = 0: draft K from the drafter's (top-`support`) q (or, not
    `honest`, its argmax), accept with that q, go on until two tokens are emitted; returns
    the first two emitted tokens of each."""
    ids_of, probs_of = _top(DRAFTER, support)
    last = np.zeros(N, np.int64)
    emitted: list[list[int]] = [[] for _ in range(N)]
    pending = np.arange(N)
    while len(pending):
        n = len(pending)
        drafts, q_ids, q_probs = (
            np.zeros((n, K, w), dt)
            for w, dt in ((1, np.int64), (support, np.int64), (support, np.float64))
        )
        drafts = drafts[..., 0]
        target = np.zeros((n, K + 1, V))
        prev = last[pending]
        for j in range(K):
            target[:, j] = TARGET[prev]
            q_ids[:, j], q_probs[:, j] = ids_of[prev], probs_of[prev]
            cdf = np.cumsum(q_probs[:, j], -1)
            pick = np.minimum((cdf <= rng.random(n)[:, None]).sum(-1), support - 1)
            if not honest:  # greedy drafts told as drawn from q
                pick = np.argmax(q_probs[:, j], -1)
            drafts[:, j] = q_ids[np.arange(n), j, pick]
            prev = drafts[:, j]
        target[:, K] = TARGET[prev]
        args = (drafts, q_ids, q_probs, target)
        u = rng.random((n, K + 1))
        if as_torch:
            got = accept(*(torch.from_numpy(a) for a in args), uniforms=torch.from_numpy(u))
            a, nxt = got.num_accepted.numpy(), got.next_tokens.numpy()
        else:
            got = accept(*args, uniforms=u)
            a, nxt = got.num_accepted, got.next_tokens
        for row, i in enumerate(pending):
            emitted[i] += [*drafts[row, : a[row]].tolist(), int(nxt[row])]
            last[i] = emitted[i][-1]
        pending = np.array([i for i in pending if len(emitted[i]) < 2], np.int64)
    return np.array([e[:2] for e in emitted])


def _chi_square(pairs: np.ndarray) -> float:
    counts = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    expected = N * (TARGET[0][:, None] * TARGET).reshape(-1)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("support", [1, 3, V], ids=["greedy-like", "top3", "full"])
def test_the_emitted_tokens_follow_the_target(support: int, as_torch: bool) -> None:
    pairs = _first_two(np.random.default_rng(10 + support), support, True, as_torch)
    assert _chi_square(pairs) < chi_square_critical(V * V - 1)


def test_a_q_that_is_not_the_drafts_fails_the_same_test() -> None:
    pairs = _first_two(np.random.default_rng(3), V, False, False)
    assert _chi_square(pairs) > 10 * chi_square_critical(V * V - 1)


def test_verdicts_by_hand() -> None:
    """Two rows, K = 2, V = 3. Row 0: draft 1 has p 0.2, q 0.5: kept when u < 0.4 (u = 0.3
    keeps it); draft 2 has p 0.6, q 1: u = 0.7 refuses it; the next token comes from
    max(p - q, 0) = (0.3, 0.1, 0) / 0.4 at u = 0.8: token 1. Row 1 has one draft (count 1),
    kept (p >= q); the bonus token comes from p's last row (0.1, 0.1, 0.8) at u = 0.05:
    token 0."""
    drafts = np.array([[1, 2], [0, 0]])
    q_ids = np.array([[[1, 0], [2, 0]], [[0, 1], [0, 1]]])
    q_probs = np.array([[[0.5, 0.5], [1.0, 0.0]], [[0.6, 0.4], [1.0, 0.0]]])
    target = np.array(
        [
            [[0.5, 0.2, 0.3], [0.3, 0.1, 0.6], [1, 0, 0]],
            [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1, 0, 0]],
        ]
    )
    u = np.array([[0.3, 0.7, 0.8], [0.9, 0.0, 0.05]])
    got = accept(drafts, q_ids, q_probs, target, counts=np.array([2, 1]), uniforms=u)
    assert got.num_accepted.tolist() == [1, 1]
    assert got.next_tokens.tolist() == [1, 0]
    as_torch = accept(
        *(torch.from_numpy(a) for a in (drafts, q_ids, q_probs, target)),
        counts=torch.tensor([2, 1]),
        uniforms=torch.from_numpy(u),
    )
    assert as_torch.num_accepted.tolist() == [1, 1] and as_torch.next_tokens.tolist() == [1, 0]


def test_greedy_drafts_are_kept_with_the_targets_probability() -> None:
    """q one-hot: a draft is kept exactly when u < p(draft)."""
    p = np.array([[[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]])
    for u0, kept in ((0.59, 1), (0.61, 0)):
        got = accept(
            np.array([[1]]), np.array([[[1]]]), np.ones((1, 1, 1)), p, uniforms=[[u0, 0.5]]
        )
        assert got.num_accepted.tolist() == [kept]
