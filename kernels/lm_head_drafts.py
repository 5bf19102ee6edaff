"""The LM head fused with the draft selection: logits are never written to memory.

For a few rows h ([M, K], M <= 64): ``logits = h @ w.T`` ([N, K] weight, N the
vocabulary), then, as ``select_drafts``, the masked argmax (ties to the lowest
index) and its softmax probability. Each program of the GEMV computes a tile of
BLOCK_N logits per row, rounds them to the compute dtype (as a separate matrix
product would store them), and keeps only the tile's (argmax, max, sum of
exp(logit - max)); a second kernel merges the tiles of each row. Saves writing and
re-reading the logits (2 bytes x M x 151680 for MiMo) and a kernel launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_same_device, check_tensor
from ._shared import INT32_MAX, check_gemv_args, gemv_config, gemv_tile, merge_draft_splits

__all__ = ["lm_head_drafts"]


@triton.jit
def _lm_head_tiles_kernel(
    x_ptr,  # [M, K] hidden rows (already normalized)
    w_ptr,  # [N, K] LM head
    bitmask_ptr,  # [M, W] int32 packed allowed-token bits (unused without HAS_MASK)
    part_idx_ptr,  # [M, P] int32 tile argmax, -1 if the tile allows nothing
    part_ms_ptr,  # [M, P, 2] fp32 tile (max, sum of exp(logit - max))
    logits_ptr,  # [M, N] out: the logits, -inf where not allowed (WRITE_LOGITS only)
    M,
    N,
    K,
    W,  # bitmask words per row
    P,  # tiles per row (programs)
    HAS_MASK: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    acc = gemv_tile(
        x_ptr, w_ptr, M, N, K, pid, x_ptr, False, 1, 1, False, BLOCK_M, BLOCK_N, BLOCK_K,
        DOT_PRECISION,
    )  # fmt: skip
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    allowed = m_ok[:, None] & (rn < N)[None, :]
    if HAS_MASK:
        word_idx = rn >> 5
        allowed = allowed & (word_idx < W)[None, :]
        words = tl.load(bitmask_ptr + rm[:, None] * W + word_idx[None, :], mask=allowed, other=0)
        allowed = allowed & (((words >> (rn & 31)[None, :]) & 1) != 0)
    x = tl.where(allowed, logits, float("-inf"))
    if WRITE_LOGITS:
        in_rows = m_ok[:, None] & (rn < N)[None, :]
        tl.store(logits_ptr + rm[:, None] * N + rn[None, :], x, mask=in_rows)
    tile_max = tl.max(x, axis=1)
    tile_idx = tl.min(tl.where(allowed & (x == tile_max[:, None]), rn[None, :], INT32_MAX), axis=1)
    tile_idx = tl.where(tile_idx == INT32_MAX, -1, tile_idx)
    ref = tl.where(tile_max == float("-inf"), 0.0, tile_max)
    tile_sum = tl.sum(tl.exp(x - ref[:, None]), axis=1)
    part = rm * P + pid
    tl.store(part_idx_ptr + part, tile_idx, mask=m_ok)
    tl.store(part_ms_ptr + part * 2, tile_max, mask=m_ok)
    tl.store(part_ms_ptr + part * 2 + 1, tile_sum, mask=m_ok)


def lm_head_drafts(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bitmask: torch.Tensor | None,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts of ``hidden @ weight.T`` ([M, K] x [V, K], M <= 64) under an optional bitmask.

    ``bitmask`` ([M, W] int32, xgrammar layout) or None. Returns ``(tokens [M] int64,
    probs [M] float32)``: what ``select_drafts(hidden @ weight.T, bitmask)`` returns,
    with the logits rounded to ``hidden.dtype`` as that product would store them. Given
    ``logits`` ([M, V], hidden's dtype), writes those logits into it, -inf where the
    bitmask allows no token (for a sampler to read, with no second pass over the head).
    """
    check_gemv_args(hidden, weight)
    m, k = hidden.shape
    vocab = weight.shape[0]
    if bitmask is not None:
        check_tensor("bitmask", bitmask, 2, (torch.int32,))
        check_same_device(hidden=hidden, bitmask=bitmask)
        if bitmask.shape[0] != m:
            raise ValueError(
                f"bitmask must have {m} rows (one per hidden row), got {tuple(bitmask.shape)}"
            )
    if logits is not None:
        check_tensor("logits", logits, 2, (hidden.dtype,))
        check_same_device(hidden=hidden, logits=logits)
        if logits.shape != (m, vocab):
            raise ValueError(f"logits must have shape {(m, vocab)}, got {tuple(logits.shape)}")
    tokens = torch.empty((m,), dtype=torch.int64, device=hidden.device)
    probs = torch.empty((m,), dtype=torch.float32, device=hidden.device)
    if m == 0:
        return tokens, probs
    cfg = gemv_config(m, vocab, k, hidden.dtype)
    tiles = max(1, triton.cdiv(vocab, cfg["BLOCK_N"]))
    part_idx = torch.empty((m, tiles), dtype=torch.int32, device=hidden.device)
    part_ms = torch.empty((m, tiles, 2), dtype=torch.float32, device=hidden.device)
    _lm_head_tiles_kernel[(tiles,)](
        hidden, weight, weight if bitmask is None else bitmask, part_idx, part_ms,
        part_ms if logits is None else logits, m, vocab, k,
        0 if bitmask is None else bitmask.shape[1], tiles,
        HAS_MASK=bitmask is not None, WRITE_LOGITS=logits is not None, **cfg,
    )  # fmt: skip
    merge_draft_splits[(m,)](
        part_idx, part_ms, tokens, probs, SPLITS=tiles,
        BLOCK_S=triton.next_power_of_2(tiles), num_warps=8,
    )  # fmt: skip
    return tokens, probs
