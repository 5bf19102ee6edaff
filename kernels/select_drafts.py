"""Fused masked argmax and top-1 softmax probability over rows of logits.

For each row: ``token = argmax`` of the logits over the allowed tokens (ties go to the lowest
index, as ``torch.argmax``), and ``prob = softmax(allowed logits)[token] = 1 / sum(exp(l -
max))``, in fp32. The optional bitmask uses xgrammar's packed layout: bit ``t % 32`` of int32
word ``t // 32`` allows token ``t``; tokens at or beyond ``32 * W`` are disallowed. A row
with no allowed token gets token -1 and probability 0.

A program walks (part of) one row in tiles of ``BLOCK_V`` with a running max and a rescaled
running sum (online softmax), so the logits are read once. A small batch spreads each row
over ``SPLITS`` programs (each a contiguous token range) and a second kernel merges their
(argmax, max, sum) triples.

Given a group size, the pass also writes each group's largest allowed logit: the first
pass of ``top_support``, which a sampler runs next over the same logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_same_device, check_shape, check_tensor
from ._shared import INT32_MAX, merge_draft_splits, num_sms

__all__ = ["select_drafts"]


@triton.jit
def _select_drafts_kernel(
    logits_ptr,  # [N, V] logits
    bitmask_ptr,  # [N, W] int32 packed allowed-token bits (unused without HAS_MASK)
    tok_ptr,  # [N] int64 output token (-1: none allowed), or [N, SPLITS] int32 partial argmax
    prob_ptr,  # [N] fp32 output probability, or [N, SPLITS, 2] fp32 partial (max, sum)
    max_ptr,  # [N, M] fp32 out: each group's largest allowed logit (GROUP > 0 only)
    V,  # vocabulary size
    M,  # groups per row
    W,  # bitmask words per row
    tiles_per_split,  # BLOCK_V tiles walked by one program
    HAS_MASK: tl.constexpr,  # apply the bitmask
    SPLITS: tl.constexpr,  # programs per row (1: this program writes the final outputs)
    BLOCK_V: tl.constexpr,  # tokens per iteration
    GROUP: tl.constexpr,  # tokens per group of the maxima (0: none written)
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    best_idx = tl.full([], -1, tl.int32)  # lowest allowed index of the running max
    run_max = tl.full([], float("-inf"), tl.float32)  # max of the allowed logits
    run_sum = tl.zeros([], tl.float32)  # sum of exp(allowed logit - run_max)
    v_start = split * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_start + tiles_per_split * BLOCK_V, V)
    for start in range(v_start, v_end, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        allowed = offs < v_end
        x = tl.load(logits_ptr + row * V + offs, mask=allowed, other=float("-inf"))
        x = x.to(tl.float32)
        if HAS_MASK:
            word_idx = offs >> 5
            allowed = allowed & (word_idx < W)
            words = tl.load(bitmask_ptr + row * W + word_idx, mask=allowed, other=0)
            allowed = allowed & (((words >> (offs & 31)) & 1) != 0)
        x = tl.where(allowed, x, float("-inf"))
        if GROUP > 0:
            g = start // GROUP + tl.arange(0, BLOCK_V // GROUP)
            maxima = tl.max(tl.reshape(x, [BLOCK_V // GROUP, GROUP]), axis=1)
            tl.store(max_ptr + row * M + g, maxima, mask=g < M)

        tile_max = tl.max(x, axis=0)
        tile_idx = tl.min(tl.where(allowed & (x == tile_max), offs, INT32_MAX), axis=0)
        # Strictly greater: an earlier tile keeps ties.
        better = (tile_idx != INT32_MAX) & ((best_idx < 0) | (tile_max > run_max))
        best_idx = tl.where(better, tile_idx, best_idx)

        new_max = tl.maximum(run_max, tile_max)
        ref = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - ref) + tl.sum(tl.exp(x - ref), axis=0)
        run_max = new_max

    if SPLITS == 1:
        tl.store(tok_ptr + row, best_idx.to(tl.int64))
        tl.store(prob_ptr + row, 1.0 / tl.where(run_sum > 0.0, run_sum, float("inf")))
    else:
        part = row * SPLITS + split
        tl.store(tok_ptr + part, best_idx)
        tl.store(prob_ptr + part * 2, run_max)
        tl.store(prob_ptr + part * 2 + 1, run_sum)


def select_drafts(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    *,
    num_splits: int | None = None,
    maxima: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked argmax and its softmax probability for each row of ``logits`` ([N, V]).

    ``bitmask`` ([N, W] int32, xgrammar layout) or None (every token allowed). Returns
    ``(tokens [N] int64, probs [N] float32)``. ``num_splits`` overrides how many programs
    share a row (None: from the batch and the GPU's SM count, which depends on shapes
    only and suits CUDA graphs; 1: one program per row). ``maxima`` (out [N, ceil(V /
    group)] fp32, group: a power of two): each group's largest allowed logit written there.
    """
    check_tensor("logits", logits, 2, FLOAT_DTYPES)
    n, vocab = logits.shape
    if bitmask is not None:
        check_tensor("bitmask", bitmask, 2, (torch.int32,))
        check_same_device(logits=logits, bitmask=bitmask)
        if bitmask.shape[0] != n:
            raise ValueError(
                f"bitmask must have {n} rows (one per logits row), got {tuple(bitmask.shape)}"
            )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    block_v = min(4096, triton.next_power_of_2(max(vocab, 1)))
    group_max, group = (logits, 0) if maxima is None else maxima
    if maxima is not None:
        check_tensor("maxima", group_max, 2, (torch.float32,))
        check_same_device(logits=logits, maxima=group_max)
        if group < 1 or group & (group - 1) or group > block_v:
            raise ValueError(f"group must be a power of two up to {block_v}, got {group}")
        check_shape("maxima", group_max, (n, triton.cdiv(vocab, group)))
    tokens = torch.empty((n,), dtype=torch.int64, device=logits.device)
    probs = torch.empty((n,), dtype=torch.float32, device=logits.device)
    if n == 0:
        return tokens, probs
    n_tiles = max(1, triton.cdiv(vocab, block_v))
    if num_splits is None:
        # One program per row walks ~38 tiles one dependent load after another, which
        # leaves a small batch latency-bound: spread the rows over about 2 waves of SMs.
        sms = num_sms(logits.device) if logits.is_cuda else 1
        num_splits = triton.cdiv(2 * sms, n)
    tiles_per_split = triton.cdiv(n_tiles, min(num_splits, n_tiles))
    splits = triton.cdiv(n_tiles, tiles_per_split)
    if splits == 1:
        part_idx, part_ms = tokens, probs
    else:
        part_idx = torch.empty((n, splits), dtype=torch.int32, device=logits.device)
        part_ms = torch.empty((n, splits, 2), dtype=torch.float32, device=logits.device)
    _select_drafts_kernel[(n, splits)](
        logits,
        logits if bitmask is None else bitmask,
        part_idx,
        part_ms,
        group_max,
        vocab,
        group_max.shape[1] if group else 0,
        0 if bitmask is None else bitmask.shape[1],
        tiles_per_split,
        HAS_MASK=bitmask is not None,
        SPLITS=splits,
        BLOCK_V=block_v,
        GROUP=group,
        num_warps=8 if block_v >= 2048 else 4,
    )
    if splits > 1:
        merge_draft_splits[(n,)](
            part_idx,
            part_ms,
            tokens,
            probs,
            SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            num_warps=1,
        )
    return tokens, probs
