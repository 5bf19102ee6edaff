"""Each row's S largest logits, exactly, ranked by value then by the lower id, without
ranking the whole vocabulary.

A row is cut into groups of tokens. (1) Each tile writes its groups' maxima. (2) A row's
threshold is the S-th largest of its group maxima: S tokens reach it, so the S largest
tokens all do. (3) Each tile appends to the row's candidates its tokens above the threshold
and its first S tokens equal to it (ties rank by the lower id, so no other tie can be among
the S), reading only its groups whose maximum reaches the threshold. Fewer than S groups
lie above a threshold, so the candidates are bounded and most logits are read once. (4) One
program per row ranks its candidates, keys that order by value then by lower id, and writes
the S first. A row with fewer than S allowed tokens (the rest -inf) is filled with the
lowest ids of the disallowed, as a full ranking would fill it.

The passes serve a sampler too: the first is skipped where the caller's own pass wrote the
group maxima (select_drafts does, as it drafts greedily), and given a sampler's parameters
the gather pass sums, per tile, the mass min-p keeps of the rows whose top-p needs the whole
vocabulary's (sample_top reads those sums): those rows' groups are all read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._checks import (
    FLOAT_DTYPES,
    SAMPLING_PARAMS,
    check_columns,
    check_same_device,
    check_shape,
    check_tensor,
)
from ._shared import needs_min_p_mass

__all__ = ["TopSupport", "top_support", "top_support_group"]

_GROUPS_PER_TILE = 16
_MAX_GROUP = 256
_RANKED = 256  # candidates ranked at a time
_INT64_MIN = tl.constexpr(-(2**63))


@triton.jit
def _keys(x, ids):
    """int64 keys that order as (value, -id): the float's bits made monotonic, then the id
    reversed (a lower id is the larger key)."""
    bits = x.to(tl.int32, bitcast=True)
    monotonic = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (monotonic.to(tl.int64) << 32) | (4294967295 - ids.to(tl.int64))


@triton.jit
def _value_and_id(keys):
    """_keys undone: (fp32 values, int64 ids)."""
    monotonic = (keys >> 32).to(tl.int32)
    bits = tl.where(monotonic < 0, monotonic ^ 0x7FFFFFFF, monotonic)
    return bits.to(tl.float32, bitcast=True), 4294967295 - (keys & 4294967295)


@triton.jit
def _group_max_kernel(
    logits_ptr,  # [N, V] logits (-inf: not allowed)
    max_ptr,  # [N, TILES * GROUPS] fp32 out: each group's largest logit
    V,
    GROUPS: tl.constexpr,  # groups per tile
    GROUP: tl.constexpr,  # tokens per group
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs = tile * GROUPS * GROUP + tl.arange(0, GROUPS * GROUP)
    x = tl.load(logits_ptr + row * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    maxima = tl.max(tl.reshape(x, [GROUPS, GROUP]), axis=1)
    tl.store(max_ptr + (row * tl.num_programs(1) + tile) * GROUPS + tl.arange(0, GROUPS), maxima)


@triton.jit
def _threshold_kernel(
    max_ptr,  # [N, M] fp32 group maxima
    threshold_ptr,  # [N] fp32 out: the S-th largest
    row_max_ptr,  # [N] fp32 out: the largest
    count_ptr,  # [N] int32 out: zeroed, the candidates' count
    M,
    S,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    maxima = tl.load(max_ptr + row * M + m, mask=m < M, other=float("-inf"))
    top = tl.topk(maxima, BLOCK_S)
    tl.store(threshold_ptr + row, tl.min(tl.where(tl.arange(0, BLOCK_S) < S, top, float("inf"))))
    tl.store(row_max_ptr + row, tl.max(top, axis=0))
    tl.store(count_ptr + row, 0)


@triton.jit
def _gather_kernel(
    logits_ptr,  # [N, V]
    max_ptr,  # [N, M] fp32 group maxima
    threshold_ptr,  # [N] fp32
    count_ptr,  # [N] int32: candidates appended so far
    cand_ptr,  # [N, CAP] int64 out: the candidates' keys
    row_max_ptr,  # [N] fp32, and the sampler's per-row parameters (HAS_MASS only):
    temp_ptr,  # fp32
    top_k_ptr,  # int64
    top_p_ptr,  # fp32
    min_p_ptr,  # fp32
    mass_ptr,  # [N, TILES] fp32 out: the tile's kept mass (0 where a row needs none)
    V,
    M,
    S,
    CAP,
    HAS_MASS: tl.constexpr,
    GROUPS: tl.constexpr,  # groups per tile
    GROUP: tl.constexpr,  # tokens per group
    LANES: tl.constexpr,  # GROUP, at least 16
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    lane = tl.arange(0, LANES)
    threshold = tl.load(threshold_ptr + row)
    needs_mass = False
    if HAS_MASS:
        needs_mass = needs_min_p_mass(row, temp_ptr, top_k_ptr, top_p_ptr)
    mass = tl.zeros([], tl.float32)
    ties_left = S  # the tile's first S ties, by id: no other tie can be among the S
    for g in range(tile * GROUPS, tile * GROUPS + GROUPS):
        # Only a group whose maximum reaches the threshold holds candidates: most groups'
        # logits are not read at all, but where a row needs the whole vocabulary's mass.
        reaches = tl.load(max_ptr + row * M + g, mask=g < M, other=float("-inf")) >= threshold
        if reaches | needs_mass:
            offs = g * GROUP + lane
            inside = (lane < GROUP) & (offs < V)
            x = tl.load(logits_ptr + row * V + offs, mask=inside, other=float("-inf"))
            x = x.to(tl.float32)
            if reaches:
                tie = inside & (x == threshold)
                take = (inside & (x > threshold)) | (
                    tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= ties_left)
                )
                ties_left -= tl.minimum(tl.sum(tie.to(tl.int32), axis=0), ties_left)
                taken = take.to(tl.int32)
                n = tl.sum(taken, axis=0)
                if n > 0:
                    base = tl.atomic_add(count_ptr + row, n)
                    slot = base + tl.cumsum(taken, axis=0) - 1
                    # Within the bound; a caller's maxima lower than the true ones could
                    # pass it.
                    tl.store(cand_ptr + row * CAP + slot, _keys(x, offs), mask=take & (slot < CAP))
            if needs_mass:
                e = tl.exp((x - tl.load(row_max_ptr + row)) / tl.load(temp_ptr + row))
                mass += tl.sum(tl.where(e >= tl.load(min_p_ptr + row), e, 0.0), axis=0)
    if HAS_MASS:
        tl.store(mass_ptr + row * tl.num_programs(1) + tile, mass)


@triton.jit
def _rank_kernel(
    cand_ptr,  # [N, CAP] int64 candidates' keys
    count_ptr,  # [N] int32
    values_ptr,  # [N, S] fp32 out
    ids_ptr,  # [N, S] int64 out
    S,
    CAP,
    RANKED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(count_ptr + row), CAP)
    r = tl.arange(0, RANKED)
    best = tl.full([RANKED], _INT64_MIN, tl.int64)
    for start in range(0, n, RANKED):
        more = tl.load(cand_ptr + row * CAP + start + r, mask=start + r < n, other=_INT64_MIN)
        best = tl.topk(tl.reshape(tl.join(best, more), [2 * RANKED]), RANKED)
    values, ids = _value_and_id(best)
    first = r < S
    tl.store(values_ptr + row * S + r, values, mask=first)
    tl.store(ids_ptr + row * S + r, ids, mask=first)


class TopSupport(NamedTuple):
    values: torch.Tensor  # [N, S] fp32, the largest first
    ids: torch.Tensor  # [N, S] int64
    kept_mass: torch.Tensor | None  # [N, tiles] fp32 per-tile sums (given a sampler's params)


def top_support_group(vocab: int, support: int) -> int:
    """Tokens per group: at least `support` groups, so that the threshold is some group's
    maximum; a power of two, at most 256."""
    return min(_MAX_GROUP, 1 << ((vocab // support).bit_length() - 1))


def top_support(
    logits: torch.Tensor,
    support: int,
    *,
    maxima: tuple[torch.Tensor, int] | None = None,
    params: tuple[torch.Tensor, ...] | None = None,
) -> TopSupport:
    """The ``support`` largest of each row of ``logits`` ([N, V], -inf where not allowed),
    largest first, ties to the lower id.

    ``maxima``: (each group's largest logit [N, ceil(V / group)] fp32, group), with group
    ``top_support_group(V, support)``, where the caller has them. ``params``: a sampler's
    (temperature fp32, top_k int64, top_p fp32, min_p fp32), each [N]: the kept mass is
    summed for the rows with temperature > 0, no top-k cut and top_p < 1, as
    exp((logit - row max) / temperature) over the tokens where that reaches min_p.
    """
    check_tensor("logits", logits, 2, FLOAT_DTYPES)
    n, vocab = logits.shape
    if not 0 < support <= vocab:
        raise ValueError(f"support must be in [1, {vocab}] (the vocabulary), got {support}")
    if vocab >= 2**31:
        raise ValueError(f"a vocabulary of {vocab} tokens does not fit int32 ids")
    dev = logits.device
    group = top_support_group(vocab, support)
    groups = triton.cdiv(vocab, group)
    if maxima is not None:
        maxima, given = maxima
        check_tensor("maxima", maxima, 2, (torch.float32,))
        check_same_device(logits=logits, maxima=maxima)
        if given != group:
            raise ValueError(f"maxima must be of groups of {group} tokens, got {given}")
        check_shape("maxima", maxima, (n, groups))
    if params is not None:
        check_columns(params, SAMPLING_PARAMS, n)
        check_same_device(logits=logits, **{f"column {i}": t for i, t in enumerate(params)})
    block = group * _GROUPS_PER_TILE
    tiles = triton.cdiv(vocab, block)
    values = torch.empty(n, support, dtype=torch.float32, device=dev)
    ids = torch.empty(n, support, dtype=torch.int64, device=dev)
    kept_mass = None if params is None else torch.empty(n, tiles, dtype=torch.float32, device=dev)
    if n == 0:
        return TopSupport(values, ids, kept_mass)
    count = torch.empty(n, dtype=torch.int32, device=dev)
    threshold, row_max = torch.empty(2, n, dtype=torch.float32, device=dev)
    # Above the threshold: fewer than `support` groups; at it: `support` a tile at most.
    cap = (support - 1) * group + tiles * support
    candidates = torch.empty(n, cap, dtype=torch.int64, device=dev)
    warps = 8 if block >= 2048 else 4
    if maxima is None:
        maxima = torch.empty(n, tiles * _GROUPS_PER_TILE, dtype=torch.float32, device=dev)
        _group_max_kernel[(n, tiles)](
            logits, maxima, vocab, GROUPS=_GROUPS_PER_TILE, GROUP=group, num_warps=warps
        )
    block_s = max(2, triton.next_power_of_2(support))  # tl.topk takes 2 or more
    _threshold_kernel[(n,)](
        maxima, threshold, row_max, count, maxima.shape[1], support,
        BLOCK_M=max(triton.next_power_of_2(maxima.shape[1]), block_s), BLOCK_S=block_s,
    )  # fmt: skip
    _gather_kernel[(n, tiles)](
        logits, maxima, threshold, count, candidates, row_max, *(params or (row_max,) * 4),
        row_max if kept_mass is None else kept_mass, vocab, maxima.shape[1], support, cap,
        HAS_MASS=params is not None, GROUPS=_GROUPS_PER_TILE, GROUP=group,
        LANES=max(group, 16),
    )  # fmt: skip
    _rank_kernel[(n,)](
        candidates, count, values, ids, support, cap, RANKED=max(_RANKED, block_s), num_warps=4
    )
    return TopSupport(values, ids, kept_mass)
