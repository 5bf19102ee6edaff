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


def top_support(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest logits of each row and their ids ([N, width] each), the largest
    first, ties to the lower id (topk orders ties as it likes)."""
    values, ids = logits.topk(min(width, logits.shape[-1]), dim=-1)
    ids, order = ids.sort(-1)
    values, order = values.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def min_p_mass(logits: torch.Tensor, top: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N]: the mass min-p keeps of each row, in units of its top token's probability: the sum
    of e = exp((logit - top) / temperature) over the tokens with e >= min_p."""
    e = ((logits.float() - top[:, None].float()) / params.temperature[:, None].float()).exp()
    return torch.where(e >= params.min_p[:, None].float(), e, torch.zeros_like(e)).sum(-1)


def processed_support(
    logits: torch.Tensor, params: SamplingParams, support: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q of each row as (token ids [N, support], probabilities [N, support]), the most
    probable first; tokens past a row's q have probability 0.

    Only the most probable tokens are ranked: `support` of them, or top_k where a row's is
    wider (a host sync: the eager path). The rest of the vocabulary enters only through
    the mass min-p keeps of it, which top-p needs where no top-k cut bounds the row."""
    # One host read: how wide to rank, and whether any row's top-p needs the unranked mass.
    top_k, top_p = params.top_k, params.top_p[:, None].float()
    unbounded = (top_k <= 0) & (params.top_p < 1)
    widest, needs_mass = torch.stack([top_k.max(), unbounded.any().long()]).tolist()
    values, ids = top_support(logits, max(support, widest))
    values = values.float()
    e = ((values - values[:, :1]) / params.temperature[:, None].float()).exp()
    # min-p: under min_p times the top probability, a token goes; top-k by rank (0: none).
    rank = torch.arange(values.shape[-1], device=logits.device)[None, :]
    keep = (e >= params.min_p[:, None].float()) & ((top_k[:, None] <= 0) | (rank < top_k[:, None]))
    kept = torch.where(keep, e, torch.zeros_like(e))
    total = kept.sum(-1)  # a top-k cut keeps ranked tokens only
    if needs_mass:
        total = torch.where(unbounded, min_p_mass(logits, values[:, 0], params), total)
    # top-p (below 1) over what is left: a token stays while the mass before it is short
    # of top_p (the first always stays).
    mass = kept / total[:, None]
    before = mass.cumsum(-1) - mass
    kept = torch.where((before < top_p) | (top_p >= 1), kept, torch.zeros_like(kept))
    ids, kept = ids[:, :support], kept[:, :support]
    return ids, kept / kept.sum(-1, keepdim=True)


def draw(ids: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from its q (ids, probs) by inverse CDF at its uniform."""
    cdf = probs.double().cumsum(-1)
    at = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None].contiguous(), right=True)
    at = at.clamp(max=probs.shape[-1] - 1)
    return ids.gather(-1, at)[:, 0]


@dataclass
class RowSampling:
    """How each row of a decode step chooses its draft, on the device: its parameters
    (temperature 0: greedy), and the key words of its draws other than the position."""

    params: SamplingParams
    seeds: torch.Tensor  # [N] int64 (a uint64 seed's bits)
    states: torch.Tensor  # [N] int64: the state's id
    support: int  # the most tokens a q holds
    wide: bool = False  # some row's top_k is above `support` (known on the host)


@dataclass
class Selected:
    """Each row's draft, its probability (q(draft) when sampled, the top-1 probability
    when greedy) and its q as a support (a greedy row's: the draft alone, probability 1)."""

    tokens: torch.Tensor  # [N] int64
    probs: torch.Tensor  # [N] float32
    q_ids: torch.Tensor  # [N, support] int64
    q_probs: torch.Tensor  # [N, support] float32


def select(
    logits: torch.Tensor,
    greedy: tuple[torch.Tensor, torch.Tensor],
    rows: RowSampling,
    positions: torch.Tensor,
    index: torch.Tensor,
) -> Selected:
    """The drafts of rows whose logits [N, V] are given (-inf where a grammar allows no
    token): sampled rows draw from q with the uniform keyed by (seed, state, position,
    index) of the drafted token; greedy rows keep `greedy` (tokens, probabilities), which
    the caller computed as the greedy path does."""
    params = rows.params
    sampled = params.temperature > 0
    safe = SamplingParams(
        torch.where(sampled, params.temperature, torch.ones_like(params.temperature)),
        params.top_k,
        params.top_p,
        params.min_p,
    )
    ids, q = processed_support(logits, safe, rows.support)
    drawn = draw(ids, q, counter_uniforms(rows.seeds, rows.states, positions, index))
    q_drawn = (q * (ids == drawn[:, None])).sum(-1)
    tokens, probs = greedy
    first = torch.arange(ids.shape[1], device=ids.device) == 0  # a greedy q: the draft alone
    return Selected(
        tokens=torch.where(sampled, drawn, tokens.long()),
        probs=torch.where(sampled, q_drawn, probs.float()),
        q_ids=torch.where(sampled[:, None], ids, torch.where(first, tokens.long()[:, None], 0)),
        q_probs=torch.where(sampled[:, None], q, first.float().expand_as(q)),
    )
