"""Sampled drafts: the head's distribution processed as a request asks, cut to a sparse q, and
a draw from it that depends on nothing but the draw's own key.

The processing follows vLLM's sampler, in its order: temperature, then min-p (tokens under
min_p times the top probability go), then top-k, then top-p (the smallest set of most
probable tokens whose mass reaches top_p). What is left is cut to at most `support`
tokens, the most probable, and renormalised: that is q, exactly what the draft is drawn
from and what the verifier is told (speculative sampling is exact whatever q is, so the cut
changes how many drafts are kept, never what a verifier emits).

A draw's uniform comes from a counter-based generator keyed by (seed, state, position, draft
index), SplitMix64 over the four words: the same key gives the same draft alone or in any
batch, on any device, and a client can recompute it. Everything runs on the device without
a host sync, so it can sit inside a captured chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bits."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 bits (multiplication wraps as uint64 does)."""
    x = x + _signed(_GOLDEN)
    x = (x ^ _shift_right(x, 30)) * _signed(_MIX1)
    x = (x ^ _shift_right(x, 27)) * _signed(_MIX2)
    return x ^ _shift_right(x, 31)


def counter_uniforms(
    seed: torch.Tensor, state: torch.Tensor, position: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """A uniform in [0, 1) per key (int64 tensors of one shape), in float64: the top 53
    bits of SplitMix64 chained over seed, state, position and draft index."""
    x = _splitmix(seed)
    for word in (state, position, index):
        x = _splitmix(x ^ word)
    return _shift_right(x, 11).double() * 2.0**-53


@dataclass
class SamplingParams:
    """Per row: temperature (> 0), top_k (0: no cut), top_p (1: no cut), min_p (0: none)."""

    temperature: torch.Tensor  # [N] float
    top_k: torch.Tensor  # [N] int
    top_p: torch.Tensor  # [N] float
    min_p: torch.Tensor  # [N] float


def processed_support(
    logits: torch.Tensor, params: SamplingParams, support: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q of each row as (token ids [N, support], probabilities [N, support]), the most
    probable first; tokens past a row's q have probability 0."""
    scaled = logits.float() / params.temperature[:, None].float()
    probs, ids = scaled.softmax(-1).sort(-1, descending=True)
    # min-p: under min_p times the top probability, a token goes.
    keep = probs >= params.min_p[:, None].float() * probs[:, :1]
    # top-k by rank (0: every token).
    rank = torch.arange(probs.shape[-1], device=logits.device)[None, :]
    keep &= (params.top_k[:, None] <= 0) | (rank < params.top_k[:, None])
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    # top-p over what is left: a token stays while the mass before it is short of top_p
    # (the first always stays).
    mass = probs / probs.sum(-1, keepdim=True)
    before = mass.cumsum(-1) - mass
    probs = torch.where(before < params.top_p[:, None].float(), probs, torch.zeros_like(probs))
    ids, probs = ids[:, :support], probs[:, :support]
    return ids, probs / probs.sum(-1, keepdim=True)


def draw(ids: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from its q (ids, probs) by inverse CDF at its uniform."""
    cdf = probs.double().cumsum(-1)
    at = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None].contiguous(), right=True)
    at = at.clamp(max=probs.shape[-1] - 1)
    return ids.gather(-1, at)[:, 0]
