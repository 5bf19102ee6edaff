"""The two input RMSNorms of an MTP layer, fused, writing the concatenated projection input.

``out = cat[norm_e(embeds), norm_h(hiddens)]`` when ``embed_first`` (DeepSeek-V3, GLM-4.5,
Qwen3-Next), else ``cat[norm_h(hiddens), norm_e(embeds)]`` (MiMo). The embedding row is
zeroed where ``positions == 0`` (before its norm, so that half of the output is 0), as vLLM
does for the first row of a sequence in MiMo, DeepSeek-V3 and GLM (``mask_first``; Qwen3-Next
keeps it). One program handles one row, both halves. Given the rows' ``tokens``, the
kernel reads their embeddings from the table itself (no separate lookup launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_same_device, check_same_dtype, check_shape, check_tensor
from ._shared import rms_norm_row, row_warps

__all__ = ["mtp_input_norms"]


@triton.jit
def _mtp_input_norms_kernel(
    e_ptr,  # [N, H] token embeddings, or the [V, H] table (TOKENS)
    tok_ptr,  # [N] int64 token ids (TOKENS only)
    h_ptr,  # [N, H] hidden states
    ew_ptr,  # [H] embedding norm scale
    hw_ptr,  # [H] hidden norm scale
    pos_ptr,  # [N] int64 positions; the embedding is zeroed where 0 (MASK_FIRST)
    out_ptr,  # [N, 2H] output, dtype of embeds
    H,  # hidden size
    eps,  # variance epsilon
    EMBED_FIRST: tl.constexpr,  # embedding half first (else hidden half first)
    UNIT_OFFSET: tl.constexpr,  # scale by (1 + w) instead of w
    MASK_FIRST: tl.constexpr,  # zero the embedding at position 0
    TOKENS: tl.constexpr,  # e_ptr is the table, row r reads tokens[r]
    BLOCK_H: tl.constexpr,  # next power of two >= H
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H

    e_row = tl.load(tok_ptr + row).to(tl.int64) if TOKENS else row
    e = tl.load(e_ptr + e_row * H + cols, mask=mask, other=0.0).to(tl.float32)
    if MASK_FIRST:
        e = tl.where(tl.load(pos_ptr + row) != 0, e, 0.0)
    e = rms_norm_row(e, ew_ptr, cols, mask, H, eps, UNIT_OFFSET)
    h = tl.load(h_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    h = rms_norm_row(h, hw_ptr, cols, mask, H, eps, UNIT_OFFSET)

    out_row = out_ptr + row * 2 * H
    if EMBED_FIRST:
        first, second = e, h
    else:
        first, second = h, e
    tl.store(out_row + cols, first.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + H + cols, second.to(out_ptr.dtype.element_ty), mask=mask)


def mtp_input_norms(
    embeds: torch.Tensor,
    hiddens: torch.Tensor,
    embed_weight: torch.Tensor,
    hidden_weight: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    *,
    embed_first: bool,
    unit_offset: bool = False,
    mask_first: bool = True,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalize ``embeds`` and ``hiddens`` ([N, H] each) into one [N, 2H] tensor. With
    ``tokens`` ([N] int64), ``embeds`` is the embedding table [V, H] and row r's
    embedding is its row tokens[r] (ids must lie in the table: they are not checked here)."""
    check_tensor("embeds", embeds, 2, FLOAT_DTYPES)
    check_tensor("hiddens", hiddens, 2, FLOAT_DTYPES)
    check_tensor("embed_weight", embed_weight, 1, FLOAT_DTYPES)
    check_tensor("hidden_weight", hidden_weight, 1, FLOAT_DTYPES)
    check_tensor("positions", positions, 1, (torch.int64,))
    check_same_dtype(embeds=embeds, hiddens=hiddens)
    check_same_device(
        embeds=embeds,
        hiddens=hiddens,
        embed_weight=embed_weight,
        hidden_weight=hidden_weight,
        positions=positions,
    )
    n, h = embeds.shape
    if tokens is not None:
        check_tensor("tokens", tokens, 1, (torch.int64,))
        check_same_device(embeds=embeds, tokens=tokens)
        n = tokens.shape[0]
    check_shape("hiddens", hiddens, (n, h))
    check_shape("embed_weight", embed_weight, (h,))
    check_shape("hidden_weight", hidden_weight, (h,))
    check_shape("positions", positions, (n,))
    out = torch.empty((n, 2 * h), dtype=embeds.dtype, device=embeds.device)
    if n == 0:
        return out
    block_h = triton.next_power_of_2(h)
    _mtp_input_norms_kernel[(n,)](
        embeds,
        positions if tokens is None else tokens,
        hiddens,
        embed_weight,
        hidden_weight,
        positions,
        out,
        h,
        float(eps),
        EMBED_FIRST=embed_first,
        UNIT_OFFSET=unit_offset,
        MASK_FIRST=mask_first,
        TOKENS=tokens is not None,
        BLOCK_H=block_h,
        num_warps=row_warps(block_h),
    )
    return out
