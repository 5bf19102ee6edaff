"""DeepSeek MLA's cache write: RoPE on k_pe, then c and k_pe into the paged latent cache.

DeepSeek-V2/V3 rotate their qk_rope_head_dim (P) dims INTERLEAVED (GPT-J style): pair i is
(x[2i], x[2i+1]), rotated by angle i,

    y[2i]     = x[2i]     cos_i - x[2i + 1] sin_i
    y[2i + 1] = x[2i + 1] cos_i + x[2i]     sin_i

which is DeepSeek's reference ``view_as_complex(x.view(..., P/2, 2)) * freqs_cis``. vLLM's
``DeepseekV2MLAAttention`` builds its rotary embedding with ``get_rope(...,
is_neox_style=False)`` (checked in vllm/model_executor/models/deepseek_v2.py), i.e. this
layout, not the rotate_half pairs (j, j + P/2) of ``rope_write_kv``. ``cos_sin``
([max_pos, P] fp32) holds the P/2 cos columns then the P/2 sin columns of each position,
as vLLM's cos_sin_cache does (for DeepSeek's YaRN the mscale is already folded in).

``mla_write_latent`` stores, for row i with s = slots[i] >= 0, c[i] (R values) and the
rotated k_pe[i] (P values) at flat slot s of ``latent`` ([num_blocks, block_size, R + P]:
block s // block_size, offset s % block_size); a negative slot writes nothing (padding).
c and k_pe are only read: they may be strided column slices of the kv_a projection's
[N, R + P] output. ``rope_interleaved`` rotates q_pe ([N, H, P], rows and heads strided,
e.g. a slice of the [N, H, qk_nope + qk_rope] query) in place the same way. The math runs
in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    FLOAT_DTYPES,
    check_kind,
    check_rows,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)

__all__ = ["mla_write_latent", "rope_interleaved"]


@triton.jit
def _mla_write_latent_kernel(
    c_ptr,  # [N, R] latent (row stride c_stride)
    kpe_ptr,  # [N, P] unrotated k_pe (row stride kpe_stride)
    pos_ptr,  # [N] int64 positions (rows of cos_sin)
    cos_sin_ptr,  # [max_pos, P] fp32: P/2 cos columns then P/2 sin columns
    latent_ptr,  # [num_blocks, block_size, R + P] paged latent cache
    slot_ptr,  # [N] int64 flat cache slots; < 0 skips the row
    c_stride,  # elements between rows of c
    kpe_stride,  # elements between rows of k_pe
    R: tl.constexpr,  # latent width
    P_HALF: tl.constexpr,  # rotary pairs (P / 2)
    BLOCK_R: tl.constexpr,  # next power of two >= R
    BLOCK_HALF: tl.constexpr,  # next power of two >= P_HALF
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        # The cache is contiguous: slot * (R + P) is block * (block_size * (R + P)) + offset
        # * (R + P).
        dst = latent_ptr + slot * (R + 2 * P_HALF)
        rd = tl.arange(0, BLOCK_R)
        c = tl.load(c_ptr + row * c_stride + rd, mask=rd < R)
        tl.store(dst + rd, c.to(latent_ptr.dtype.element_ty), mask=rd < R)

        i = tl.arange(0, BLOCK_HALF)
        ok = i < P_HALF
        pos = tl.load(pos_ptr + row)
        cos = tl.load(cos_sin_ptr + pos * 2 * P_HALF + i, mask=ok, other=0.0)
        sin = tl.load(cos_sin_ptr + pos * 2 * P_HALF + P_HALF + i, mask=ok, other=0.0)
        src = kpe_ptr + row * kpe_stride + 2 * i
        x0 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(src + 1, mask=ok, other=0.0).to(tl.float32)
        y0 = x0 * cos - x1 * sin
        y1 = x1 * cos + x0 * sin
        tl.store(dst + R + 2 * i, y0.to(latent_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + R + 2 * i + 1, y1.to(latent_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_interleaved_kernel(
    x_ptr,  # [N, H, 2 * P_HALF] rotated in place, strides (x_s0, x_s1, 1)
    pos_ptr,  # [N] int64 positions
    cos_sin_ptr,  # [max_pos, 2 * P_HALF] fp32: cos columns then sin columns
    x_s0,  # elements between rows
    x_s1,  # elements between heads
    H,  # heads
    P_HALF: tl.constexpr,  # rotary pairs
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_HALF: tl.constexpr,  # next power of two >= P_HALF
):
    row = tl.program_id(0).to(tl.int64)
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    pos = tl.load(pos_ptr + row)
    cos = tl.load(cos_sin_ptr + pos * 2 * P_HALF + i, mask=i < P_HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * 2 * P_HALF + P_HALF + i, mask=i < P_HALF, other=0.0)
    mask = (heads < H) & (i < P_HALF)
    ptr = x_ptr + row * x_s0 + heads * x_s1 + 2 * i
    x0 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(ptr + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x0 * cos - x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + 1, (x1 * cos + x0 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def _check_cos_sin(cos_sin: torch.Tensor, p: int) -> None:
    if p % 2 or p == 0:
        raise ValueError(f"the rotary width (qk_rope_head_dim) must be even and > 0, got {p}")
    if cos_sin.shape[1] != p:
        raise ValueError(f"cos_sin's width must be the rotary width {p}, got {cos_sin.shape[1]}")


def mla_write_latent(
    c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    latent: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store c ([N, R]) and interleaved-RoPE-rotated k_pe ([N, P]) at ``slots`` of ``latent``.

    ``positions`` ([N] int64) picks each row's ``cos_sin`` row; ``slots`` ([N] int64) its
    flat cache slot (< 0: nothing written). c and k_pe may be strided (contiguous rows);
    neither is modified.
    """
    check_rows("c", c, 2, FLOAT_DTYPES)
    check_rows("k_pe", k_pe, 2, FLOAT_DTYPES)
    check_tensor("positions", positions, 1, (torch.int64,))
    check_tensor("cos_sin", cos_sin, 2, (torch.float32,))
    check_tensor("latent", latent, 3, FLOAT_DTYPES)
    check_tensor("slots", slots, 1, (torch.int64,))
    check_same_dtype(c=c, k_pe=k_pe, latent=latent)
    check_same_device(
        c=c, k_pe=k_pe, positions=positions, cos_sin=cos_sin, latent=latent, slots=slots
    )
    n, r = c.shape
    p = k_pe.shape[1]
    check_shape("k_pe", k_pe, (n, p))
    check_shape("positions", positions, (n,))
    check_shape("slots", slots, (n,))
    _check_cos_sin(cos_sin, p)
    if latent.shape[2] != r + p:
        raise ValueError(
            f"latent must have shape [num_blocks, block_size, {r} + {p}], got {tuple(latent.shape)}"
        )
    if n == 0:
        return
    _mla_write_latent_kernel[(n,)](
        c,
        k_pe,
        positions,
        cos_sin,
        latent,
        slots,
        c.stride(0),
        k_pe.stride(0),
        R=r,
        P_HALF=p // 2,
        BLOCK_R=triton.next_power_of_2(r),
        BLOCK_HALF=triton.next_power_of_2(p // 2),
        num_warps=2 if r >= 256 else 1,
    )


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate ``x`` ([N, H, P], e.g. q_pe) in place with interleaved (GPT-J) RoPE.

    Row i uses row ``positions[i]`` (int64) of ``cos_sin`` ([max_pos, P] fp32). Rows and
    heads may be strided; the last dim must be contiguous.
    """
    x = check_kind("x", x, 3, FLOAT_DTYPES)
    if x.shape[2] > 1 and x.stride(2) != 1:
        raise ValueError(f"x's last dim must be contiguous, got strides {x.stride()}")
    check_tensor("positions", positions, 1, (torch.int64,))
    check_tensor("cos_sin", cos_sin, 2, (torch.float32,))
    check_same_device(x=x, positions=positions, cos_sin=cos_sin)
    n, h, p = x.shape
    check_shape("positions", positions, (n,))
    _check_cos_sin(cos_sin, p)
    if n == 0 or h == 0:
        return
    half = p // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(h), max(1, 4096 // block_half))
    _rope_interleaved_kernel[(n, triton.cdiv(h, block_h))](
        x,
        positions,
        cos_sin,
        x.stride(0),
        x.stride(1),
        h,
        P_HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
