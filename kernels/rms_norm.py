"""RMSNorm over the last dimension of a 2-D tensor.

``y = x / sqrt(mean(x**2) + eps) * w``, computed in fp32 and cast back to ``x.dtype``.
With ``unit_offset=True`` the scale is ``(1 + w)`` (Qwen3-Next / Gemma style).

``add_rms_norm`` first adds a residual branch in place (``x += delta``, rounded to
``x.dtype`` as an unfused add would be) and normalizes the sum: one kernel where a
decoder layer would launch two, twice per step.

``qk_norm`` normalizes every head of q and of k in place, where they lie in a fused
projection's output (strided views): one kernel for what would be two copies and two
norms.

One program normalizes one row; the whole row is held in registers, which suits hidden
sizes up to a few tens of thousands. The per-row body, ``rms_norm_row``, is in ``_shared``:
the fused MTP input norms use it too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_rows, check_same_device, check_shape, check_tensor
from ._shared import rms_norm_row, row_warps

__all__ = ["add_rms_norm", "qk_norm", "rms_norm"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, H] input rows
    w_ptr,  # [H] scale
    y_ptr,  # [N, H] output rows, dtype of x
    H,  # hidden size (row stride of x and y: both contiguous)
    eps,  # variance epsilon
    UNIT_OFFSET: tl.constexpr,  # scale by (1 + w) instead of w
    BLOCK_H: tl.constexpr,  # next power of two >= H
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    y = rms_norm_row(x, w_ptr, cols, mask, H, eps, UNIT_OFFSET)
    tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm of each row of ``x`` ([N, H]) scaled by ``weight`` ([H]); returns [N, H]."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 1, FLOAT_DTYPES)
    check_same_device(x=x, weight=weight)
    n, h = x.shape
    check_shape("weight", weight, (h,))
    y = torch.empty_like(x)
    if n == 0:
        return y
    block_h = triton.next_power_of_2(h)
    _rms_norm_kernel[(n,)](
        x,
        weight,
        y,
        h,
        float(eps),
        UNIT_OFFSET=unit_offset,
        BLOCK_H=block_h,
        num_warps=row_warps(block_h),
    )
    return y


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [N, H] residual stream, updated in place to x + delta
    d_ptr,  # [N, H] residual branch
    w_ptr,  # [H] scale
    y_ptr,  # [N, H] output rows, dtype of x
    H,  # hidden size (row stride of x, delta and y: all contiguous)
    eps,  # variance epsilon
    UNIT_OFFSET: tl.constexpr,  # scale by (1 + w) instead of w
    BLOCK_H: tl.constexpr,  # next power of two >= H
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + d).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * H + cols, total, mask=mask)
    y = rms_norm_row(total.to(tl.float32), w_ptr, cols, mask, H, eps, UNIT_OFFSET)
    tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> torch.Tensor:
    """``x += delta`` in place ([N, H] each), then returns the RMSNorm of the sum [N, H]."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("delta", delta, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 1, FLOAT_DTYPES)
    check_same_device(x=x, delta=delta, weight=weight)
    n, h = x.shape
    check_shape("delta", delta, (n, h))
    check_shape("weight", weight, (h,))
    y = torch.empty_like(x)
    if n == 0:
        return y
    block_h = triton.next_power_of_2(h)
    _add_rms_norm_kernel[(n,)](
        x,
        delta,
        weight,
        y,
        h,
        float(eps),
        UNIT_OFFSET=unit_offset,
        BLOCK_H=block_h,
        num_warps=row_warps(block_h),
    )
    return y


@triton.jit
def _qk_norm_kernel(
    q_ptr,  # [N, HQ, D], rows q_row apart, each row contiguous; normalized in place
    k_ptr,  # [N, HK, D], rows k_row apart, likewise
    wq_ptr,  # [D] q's scale
    wk_ptr,  # [D] k's scale
    q_row,  # row strides (elements)
    k_row,
    HQ,  # q heads; programs past them take k's heads
    D,  # head dim
    eps,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if head < HQ:
        ptrs = q_ptr + row * q_row + head * D + cols
        w_ptr = wq_ptr
    else:
        ptrs = k_ptr + row * k_row + (head - HQ) * D + cols
        w_ptr = wk_ptr
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    y = rms_norm_row(x, w_ptr, cols, mask, D, eps, UNIT_OFFSET)
    tl.store(ptrs, y.to(q_ptr.dtype.element_ty), mask=mask)


def qk_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> None:
    """RMSNorm of each head of ``q`` ([N, Hq, D]) and ``k`` ([N, Hk, D]) by ``q_weight`` /
    ``k_weight`` ([D]), in place. Their rows may be strided (each row's heads contiguous),
    as views of one fused projection's output are; q and k must not overlap."""
    check_rows("q", q, 3, FLOAT_DTYPES)
    check_rows("k", k, 3, FLOAT_DTYPES)
    check_tensor("q_weight", q_weight, 1, FLOAT_DTYPES)
    check_tensor("k_weight", k_weight, 1, FLOAT_DTYPES)
    check_same_device(q=q, k=k, q_weight=q_weight, k_weight=k_weight)
    n, hq, d = q.shape
    if k.dtype != q.dtype or k.shape[0] != n or k.shape[2] != d:
        raise ValueError(
            f"k must be [N, Hk, D] like q ({tuple(q.shape)}, {q.dtype}), got "
            f"{tuple(k.shape)}, {k.dtype}"
        )
    check_shape("q_weight", q_weight, (d,))
    check_shape("k_weight", k_weight, (d,))
    if n == 0 or hq + k.shape[1] == 0:
        return
    block_d = triton.next_power_of_2(d)
    _qk_norm_kernel[(n, hq + k.shape[1])](
        q,
        k,
        q_weight,
        k_weight,
        q.stride(0),
        k.stride(0),
        hq,
        d,
        float(eps),
        UNIT_OFFSET=unit_offset,
        BLOCK_D=block_d,
        num_warps=row_warps(block_d),
    )
