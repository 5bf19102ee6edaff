"""Neox-style rotary embedding of q and k, fused with the write of k and v into a paged cache.

For each row i at position p = positions[i], the first ROT dims of every head of q and k
are rotated (rotate_half: the dims pair (j, j + ROT/2)) with cos/sin read from row p of
``cos_sin`` ([max_pos, ROT]: ROT/2 cos columns then ROT/2 sin columns, fp32); dims ROT..D
are left as they are (partial rotary). q and k are updated in place, as vLLM's rotary
embedding does, and the rotated k and v are stored at slot s = slot_mapping[i] of the
caches ([num_blocks, block_size, Hkv, D]: block s // block_size, offset s % block_size).
A negative slot skips the cache write (padding rows). The math runs in fp32.

q, k and v may be strided views of one fused projection ([N, q + 2 kv]): only each
row must be contiguous. Reading them in place saves three copy kernels per step
(of about 25 in a decode step on an H200, each costing 1-2 us).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    FLOAT_DTYPES,
    check_rows,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)

__all__ = ["rope_write_kv"]


@triton.jit
def _rotate_heads(
    x_ptr,  # [HEADS, D] one row's heads, updated in place
    heads,  # [BLOCK_HEADS, 1] head indices
    half,  # [1, BLOCK_R] rotary pair indices
    cos,  # [1, BLOCK_R] fp32
    sin,  # [1, BLOCK_R] fp32
    HEADS,  # number of heads
    D: tl.constexpr,  # head dim
    ROT_HALF: tl.constexpr,  # half the rotary dims
):
    """Rotate the first 2 * ROT_HALF dims of each head in place; return both fp32 halves."""
    mask = (heads < HEADS) & (half < ROT_HALF)
    ptr1 = x_ptr + heads * D + half
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + ROT_HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    tl.store(ptr1, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + ROT_HALF, y2.to(x_ptr.dtype.element_ty), mask=mask)
    return y1, y2


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,  # [N, HQ, D] queries (row stride q_stride), rotated in place
    k_ptr,  # [N, HKV, D] keys (row stride k_stride), rotated in place
    v_ptr,  # [N, HKV, D] values (row stride v_stride)
    pos_ptr,  # [N] int64 positions (rows of cos_sin)
    cos_sin_ptr,  # [max_pos, 2 * ROT_HALF] fp32: cos columns then sin columns
    k_cache_ptr,  # [num_blocks, block_size, HKV, D] paged key cache
    v_cache_ptr,  # [num_blocks, block_size, HKV, D] paged value cache
    slot_ptr,  # [N] int64 cache slots (block * block_size + offset); < 0 skips the write
    q_stride,  # elements between rows of q
    k_stride,  # elements between rows of k
    v_stride,  # elements between rows of v
    HQ,  # query heads
    HKV,  # key/value heads
    D: tl.constexpr,  # head dim
    ROT_HALF: tl.constexpr,  # half the rotary dims
    BLOCK_HQ: tl.constexpr,  # next power of two >= HQ
    BLOCK_HKV: tl.constexpr,  # next power of two >= HKV
    BLOCK_R: tl.constexpr,  # next power of two >= ROT_HALF
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row)
    half = tl.arange(0, BLOCK_R)[None, :]
    cs_mask = half < ROT_HALF
    cos = tl.load(cos_sin_ptr + pos * 2 * ROT_HALF + half, mask=cs_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * 2 * ROT_HALF + ROT_HALF + half, mask=cs_mask, other=0.0)

    q_heads = tl.arange(0, BLOCK_HQ)[:, None]
    _rotate_heads(q_ptr + row * q_stride, q_heads, half, cos, sin, HQ, D, ROT_HALF)
    kv_heads = tl.arange(0, BLOCK_HKV)[:, None]
    k_row = k_ptr + row * k_stride
    k1, k2 = _rotate_heads(k_row, kv_heads, half, cos, sin, HKV, D, ROT_HALF)

    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        # The cache is contiguous: slot * HKV * D == block * (block_size * HKV * D)
        # + offset * (HKV * D).
        kc_row = k_cache_ptr + slot * HKV * D
        rot_mask = (kv_heads < HKV) & (half < ROT_HALF)
        kc_ptr1 = kc_row + kv_heads * D + half
        tl.store(kc_ptr1, k1.to(k_cache_ptr.dtype.element_ty), mask=rot_mask)
        tl.store(kc_ptr1 + ROT_HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=rot_mask)

        dims = tl.arange(0, BLOCK_D)[None, :]
        offs = kv_heads * D + dims
        head_mask = (kv_heads < HKV) & (dims < D)
        pass_mask = head_mask & (dims >= 2 * ROT_HALF)
        k_pass = tl.load(k_row + offs, mask=pass_mask, other=0.0)
        tl.store(kc_row + offs, k_pass.to(k_cache_ptr.dtype.element_ty), mask=pass_mask)
        v = tl.load(v_ptr + row * v_stride + offs, mask=head_mask, other=0.0)
        vc_row = v_cache_ptr + slot * HKV * D
        tl.store(vc_row + offs, v.to(v_cache_ptr.dtype.element_ty), mask=head_mask)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate q and k in place and store k, v at ``slot_mapping`` in the paged caches."""
    check_rows("q", q, 3, FLOAT_DTYPES)
    check_rows("k", k, 3, FLOAT_DTYPES)
    check_rows("v", v, 3, FLOAT_DTYPES)
    check_tensor("positions", positions, 1, (torch.int64,))
    check_tensor("cos_sin", cos_sin, 2, (torch.float32,))
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    check_same_dtype(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    check_same_device(
        q=q,
        k=k,
        v=v,
        positions=positions,
        cos_sin=cos_sin,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slot_mapping,
    )
    n, hq, d = q.shape
    hkv = k.shape[1]
    check_shape("k", k, (n, hkv, d))
    check_shape("v", v, (n, hkv, d))
    check_shape("positions", positions, (n,))
    check_shape("slot_mapping", slot_mapping, (n,))
    if k_cache.shape[2:] != (hkv, d):
        raise ValueError(
            f"k_cache must have shape [num_blocks, block_size, {hkv}, {d}], "
            f"got {tuple(k_cache.shape)}"
        )
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    rot = cos_sin.shape[1]
    if rot % 2 or not 0 < rot <= d:
        raise ValueError(f"cos_sin's width (rotary dims) must be even and in (0, {d}], got {rot}")
    if n == 0:
        return
    _rope_write_kv_kernel[(n,)](
        q,
        k,
        v,
        positions,
        cos_sin,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        hq,
        hkv,
        D=d,
        ROT_HALF=rot // 2,
        BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HKV=triton.next_power_of_2(hkv),
        BLOCK_R=triton.next_power_of_2(rot // 2),
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=4,
    )
