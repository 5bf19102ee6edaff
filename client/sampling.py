"""The verifier's half of speculative sampling: which drafts to keep, and the token after.

Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023), over a batch:
draft j (drawn by the drafter from q_j) is kept with probability min(1, p_j(d) / q_j(d)),
where p_j is the target's distribution at that position; at the first draft refused, the
next token is drawn from max(p_j - q_j, 0), normalised; if every draft is kept, the
bonus token is drawn from the target's next distribution. The tokens a verifier emits then
follow the target's own sampling distribution exactly, whatever q is; q only decides how
many drafts are kept. Greedy drafts are the case q = one-hot.

q travels sparse: per draft, its support (token ids) and their probabilities, which sum
to one over the support. Works on numpy arrays or torch tensors (on any device), the
target's probabilities in the verifier's own layout [B, K + 1, V].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Accepted:
    """What a verifier does next, per row: keep `num_accepted` drafts (the verdict
    ProposeBatch and Propose take), then emit `next_tokens` (the correction or the bonus
    token: the next Propose's token)."""

    num_accepted: Any  # [B] int
    next_tokens: Any  # [B] int


def accept(
    drafts,
    q_ids,
    q_probs,
    target_probs,
    *,
    counts=None,
    uniforms=None,
    rng=None,
) -> Accepted:
    """The verdicts of a batch of sampled (or greedy, one-hot q) drafts.

    drafts [B, K] int: each row's drafts (past a row's count: anything).
    q_ids [B, K, T] int, q_probs [B, K, T] float: each draft's q as its support and
        probabilities (padding: probability 0); for greedy drafts T = 1, q_probs = 1.
    target_probs [B, K + 1, V] float: the target's distribution at each draft's position,
        then at the position after the last draft (the bonus token's).
    counts [B] int: drafts per row (default K: every row full).
    uniforms [B, K + 1] in [0, 1): the draws to use, for reproducible verdicts (one per
        draft's test, the last one for the token after); default: drawn from `rng`
        (numpy.random.Generator or torch.Generator, else a fresh one).
    Returns numpy arrays for numpy inputs, torch tensors (on target_probs' device) for torch.
    """
    xp = _Namespace(target_probs)
    p = xp.asarray(target_probs, float_=True)
    drafts, q_ids, q_probs = (xp.asarray(a) for a in (drafts, q_ids, q_probs))
    b, k = drafts.shape
    counts = xp.full(b, k) if counts is None else xp.asarray(counts)
    u = xp.uniforms((b, k + 1), rng) if uniforms is None else xp.asarray(uniforms, float_=True)

    p_draft = xp.gather(p[:, :k], drafts[..., None])[..., 0]  # [B, K]
    q_draft = (q_probs * (q_ids == drafts[..., None])).sum(-1)  # [B, K]
    kept = u[:, :k] * q_draft < p_draft  # u < min(1, p / q), without dividing by q = 0
    kept &= xp.arange(k)[None, :] < counts[:, None]
    # The first draft refused, or the row's count: how many are kept.
    num_accepted = xp.cumprod(kept).sum(-1)
    rows = xp.arange(b)
    at = num_accepted  # the position whose token comes next
    p_next = p[rows, at]  # [B, V]
    refused = num_accepted < counts
    q_at = xp.clip_index(at, k - 1)
    q_dense = xp.scatter_add(xp.zeros_like(p_next), q_ids[rows, q_at], q_probs[rows, q_at])
    residual = xp.maximum(p_next - q_dense, 0.0)
    mass = residual.sum(-1, keepdims=True)
    # p == q leaves no residual (and then no draft is refused): draw from p itself.
    residual = xp.where(mass > 0, residual / xp.where(mass > 0, mass, 1.0), p_next)
    dist = xp.where(refused[:, None], residual, p_next)
    next_tokens = xp.sample(dist, u[:, k])
    return Accepted(num_accepted, next_tokens)


class _Namespace:
    """The few array operations `accept` needs, for numpy or torch alike."""

    def __init__(self, like) -> None:
        try:
            import torch
        except ImportError:  # numpy alone
            torch = None
        self.torch = torch if torch is not None and isinstance(like, torch.Tensor) else None
        self.device = like.device if self.torch else None

    def asarray(self, a, float_: bool = False):
        if self.torch:
            t = self.torch.as_tensor(a, device=self.device)
            return t.double() if float_ else t.long() if not t.is_floating_point() else t
        a = np.asarray(a)
        return a.astype(np.float64) if float_ else a

    def full(self, n: int, value: int):
        if self.torch:
            return self.torch.full((n,), value, dtype=self.torch.long, device=self.device)
        return np.full(n, value, np.int64)

    def arange(self, n: int):
        return self.torch.arange(n, device=self.device) if self.torch else np.arange(n)

    def zeros_like(self, a):
        return self.torch.zeros_like(a) if self.torch else np.zeros_like(a)

    def gather(self, a, index):
        if self.torch:
            return self.torch.gather(a, -1, index.long())
        return np.take_along_axis(a, index, axis=-1)

    def cumprod(self, kept):
        if self.torch:
            return self.torch.cumprod(kept.long(), -1)
        return np.cumprod(kept.astype(np.int64), axis=-1)

    def clip_index(self, index, high: int):
        return index.clamp(max=high) if self.torch else np.minimum(index, high)

    def scatter_add(self, dense, index, values):
        if self.torch:
            return dense.scatter_add(-1, index.long(), values.to(dense.dtype))
        rows = np.arange(dense.shape[0])[:, None]
        np.add.at(dense, (rows, index), values)
        return dense

    def maximum(self, a, value: float):
        return a.clamp(min=value) if self.torch else np.maximum(a, value)

    def where(self, condition, a, b):
        return self.torch.where(condition, a, b) if self.torch else np.where(condition, a, b)

    def uniforms(self, shape, rng):
        if self.torch:
            device = rng.device if isinstance(rng, self.torch.Generator) else self.device
            u = self.torch.rand(shape, generator=rng, dtype=self.torch.float64, device=device)
            return u.to(self.device)
        return (rng if rng is not None else np.random.default_rng()).random(shape)

    def sample(self, dist, u):
        """One token per row by inverse CDF: the first whose cumulative mass passes u."""
        cdf = dist.cumsum(-1)
        cdf = cdf / cdf[:, -1:]
        if self.torch:
            index = self.torch.searchsorted(cdf, u[:, None].to(cdf.dtype).contiguous(), right=True)[
                :, 0
            ]
            return index.clamp(max=dist.shape[-1] - 1)
        return np.minimum((cdf <= u[:, None]).sum(-1), dist.shape[-1] - 1)
