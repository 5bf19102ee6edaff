"""A draw per row from its processed distribution, cut to the most probable tokens.

Given each row's S largest logits ([N, S], from ``top_support``, in any order), for a row
with temperature t > 0: e = exp((logit - max) / t) per token; min-p keeps e >= min_p; top-k
keeps the k highest ranks (0: all); top-p (below 1) keeps a token while the kept mass
ranked before it is short of top_p of all the kept mass; q is what is left of the first
``support`` ranks, renormalised. Ranks go by value, ties to the lower id. The row draws
from q by inverse CDF at a uniform from SplitMix64 chained over its key words (seed,
state, position, index), the top 53 bits; it writes its draft, q(draft) and q as (ids,
probabilities) by rank. A row with t <= 0 writes the greedy draft it is given, its
probability, and q = the draft alone.

Only the top-p of a row without a top-k cut needs the vocabulary beyond the S: the mass
min-p keeps of all of it, which ``top_support`` sums in parts as it gathers the S. A
top_k beyond S is not this kernel's (the caller ranks wider).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import SAMPLING_PARAMS, check_columns, check_same_device, check_shape, check_tensor
from ._shared import needs_min_p_mass

__all__ = ["sample_top"]

_COLUMNS = (
    *SAMPLING_PARAMS,
    *((name, torch.int64) for name in ("seed", "state", "position", "index", "greedy tokens")),
    ("greedy probs", torch.float32),
)


@triton.jit
def _splitmix(x):
    """SplitMix64's finaliser on uint64 (multiplication wraps)."""
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _word(ptr, row):
    return tl.load(ptr + row).to(tl.uint64, bitcast=True)


@triton.jit
def _sample_kernel(
    top_ptr,  # [N, S] the row's S largest logits, any order
    top_ids_ptr,  # [N, S] int64 their ids
    part_ptr,  # [N, P] fp32 the kept mass in parts
    temp_ptr,  # [N] fp32 (<= 0: greedy)
    top_k_ptr,  # [N] int64 (0: no cut)
    top_p_ptr,  # [N] fp32
    min_p_ptr,  # [N] fp32
    seed_ptr,  # [N] int64: the four key words of the row's draw
    state_ptr,
    position_ptr,
    index_ptr,
    position_offset,  # added to the position and index words
    index_offset,
    greedy_tok_ptr,  # [N] int64: a greedy row's draft
    greedy_prob_ptr,  # [N] fp32: and its probability
    tok_ptr,  # [N] int64 out: the draft
    prob_ptr,  # [N] fp32 out: q(draft), or the greedy draft's probability
    q_ids_ptr,  # [N, SUPPORT] int64 out: q's tokens by rank
    q_probs_ptr,  # [N, SUPPORT] fp32 out: and their probabilities
    S,
    P,
    SUPPORT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    out = row * SUPPORT + s
    t = tl.load(temp_ptr + row)
    if t > 0:
        ok = s < S
        v = tl.load(top_ptr + row * S + s, mask=ok, other=float("-inf")).to(tl.float32)
        ids = tl.load(top_ids_ptr + row * S + s, mask=ok, other=0)
        # precedes[i, j]: token j ranks before token i (a higher logit, or equal and a lower id).
        vi, vj = v[:, None], v[None, :]
        precedes = ((vj > vi) | ((vj == vi) & (ids[None, :] < ids[:, None]))) & ok[None, :]
        rank = tl.where(ok, tl.sum(precedes.to(tl.int32), axis=1), BLOCK_S)
        top_k = tl.load(top_k_ptr + row)
        e = tl.where(ok, tl.exp((v - tl.max(v, axis=0)) / t), 0.0)
        keep = (e >= tl.load(min_p_ptr + row)) & ((top_k <= 0) | (rank < top_k))
        kept = tl.where(keep, e, 0.0)
        total = tl.sum(kept, axis=0)
        if needs_min_p_mass(row, temp_ptr, top_k_ptr, top_p_ptr):
            p = tl.arange(0, BLOCK_P)
            total = tl.sum(tl.load(part_ptr + row * P + p, mask=p < P, other=0.0), axis=0)
        mass = kept / total
        before = tl.sum(tl.where(precedes, mass[None, :], 0.0), axis=1)
        top_p = tl.load(top_p_ptr + row)
        top_p = tl.where(top_p < 1, top_p, float("inf"))  # 1: no cut
        kept = tl.where((before < top_p) & (rank < SUPPORT), kept, 0.0)
        q = kept / tl.sum(kept, axis=0)
        # The draw: the first rank whose cumulative probability passes u times the total.
        x = _splitmix(_word(seed_ptr, row))
        x = _splitmix(x ^ _word(state_ptr, row))
        x = _splitmix(x ^ (_word(position_ptr, row) + position_offset))
        x = _splitmix(x ^ (_word(index_ptr, row) + index_offset))
        u = (x >> 11).to(tl.float64) * (2.0**-53)
        q64 = q.to(tl.float64)
        cdf = tl.sum(tl.where(precedes, q64[None, :], 0.0), axis=1) + q64
        passes = (cdf > u * tl.sum(q64, axis=0)) & (q > 0)
        last = tl.max(tl.where(q > 0, rank, -1), axis=0)  # where rounding passes none
        at = tl.min(tl.where(passes, rank, SUPPORT), axis=0)
        at = tl.where(at == SUPPORT, last, at)
        drawn = rank == at
        tl.store(tok_ptr + row, tl.sum(tl.where(drawn, ids, 0), axis=0))
        tl.store(prob_ptr + row, tl.sum(tl.where(drawn, q, 0.0), axis=0))
        placed = ok & (rank < SUPPORT)
        tl.store(q_ids_ptr + row * SUPPORT + rank, ids, mask=placed)
        tl.store(q_probs_ptr + row * SUPPORT + rank, q, mask=placed)
    else:
        token = tl.load(greedy_tok_ptr + row)
        first = s == 0
        tl.store(tok_ptr + row, token)
        tl.store(prob_ptr + row, tl.load(greedy_prob_ptr + row))
        tl.store(q_ids_ptr + out, tl.where(first, token, 0), mask=s < SUPPORT)
        tl.store(q_probs_ptr + out, tl.where(first, 1.0, 0.0), mask=s < SUPPORT)


def sample_top(
    top: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    greedy: tuple[torch.Tensor, torch.Tensor],
    support: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_offsets: tuple[int, int] = (0, 0),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's draft as the module says.

    ``top`` (values [N, S], ids [N, S] int64, kept mass [N, P] fp32): the S >= ``support``
    largest logits in any order, and the mass min-p keeps in parts, as
    ``top_support(logits, S, params=params)`` returns them; ``params`` (temperature fp32,
    top_k int64, top_p fp32, min_p fp32), each [N], no row's top_k above S; ``keys``
    (seed, state, position, index) [N] int64 each, ``key_offsets`` added to the position
    and the index (constants of a captured step); ``greedy`` (tokens int64, probabilities
    fp32) [N]: what rows with temperature <= 0 draft.
    Returns (drafts [N] int64, their probabilities [N] fp32, q's ids [N, support] int64, q's
    probabilities [N, support] fp32), the last two written into ``out`` if given.
    """
    values, ids, kept_mass = top
    check_tensor("top values", values, 2)
    check_tensor("top ids", ids, 2, (torch.int64,))
    check_shape("top ids", ids, values.shape)
    n, width = values.shape
    if not 0 < support <= width:
        raise ValueError(f"need top values [{n}, S] with S >= {support}, got {width}")
    check_tensor("kept mass", kept_mass, 2, (torch.float32,))
    if kept_mass.shape[0] != n:
        raise ValueError(f"kept mass must have {n} rows, got {tuple(kept_mass.shape)}")
    columns = (*params, *keys, *greedy)
    check_columns(columns, _COLUMNS, n)
    check_same_device(
        top=values, kept_mass=kept_mass, **{f"column {i}": c for i, c in enumerate(columns)}
    )
    dev = values.device
    if out is None:
        out = (
            torch.empty(n, support, dtype=torch.int64, device=dev),
            torch.empty(n, support, dtype=torch.float32, device=dev),
        )
    q_ids, q_probs = out
    check_tensor("q ids", q_ids, 2, (torch.int64,))
    check_tensor("q probs", q_probs, 2, (torch.float32,))
    check_shape("q ids", q_ids, (n, support))
    check_shape("q probs", q_probs, (n, support))
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    probs = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return tokens, probs, q_ids, q_probs
    block_s = triton.next_power_of_2(width)
    _sample_kernel[(n,)](
        values, ids, kept_mass, *params, *keys, *key_offsets, *greedy, tokens, probs, q_ids,
        q_probs, width, kept_mass.shape[1], SUPPORT=support,
        BLOCK_P=triton.next_power_of_2(kept_mass.shape[1]), BLOCK_S=block_s,
        num_warps=4 if block_s <= 64 else 8,
    )  # fmt: skip
    return tokens, probs, q_ids, q_probs
