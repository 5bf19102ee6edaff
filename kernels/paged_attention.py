"""Attention of query rows over a paged KV cache (GQA), for decode and causal chunks alike.

Query row i attends the first ``context_lens[i]`` cache rows of sequence ``seq_ids[i]``,
whose pages are ``block_tables[seq_ids[i]]``: ``softmax(q k^T * scale) v``, with query head
h reading kv head ``h // (Hq / Hkv)``. Causal chunks need no extra mask: each new row of a
state simply carries its own context length (its position + 1).

A program handles one kv head for a tile of ``BLOCK_Q`` consecutive query rows, i.e. a
whole GQA group (and, for chunks, several rows of one sequence) shares each K/V tile it
loads. Keys are walked in tiles of ``BLOCK_N`` with an online softmax and fp32
accumulation, so any context length works. When the rows x kv heads do not fill the GPU
(small batch, long context), the key range is split over ``SPLITS`` programs
(flash-decoding) and a second kernel merges the partial results.

With a ``gate`` (Qwen3-Next's attention output gate) the output is scaled by its sigmoid
where it is written, rounded as the unfused ``attention * sigmoid(gate)`` would be.
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
from ._shared import gated, merge_attention_splits, num_sms

__all__ = ["paged_attention"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32


@triton.jit
def _attend(
    q_ptr,  # [N, HQ, D] queries, rows q_stride elements apart
    k_cache_ptr,  # [num_blocks, PAGE, HKV, D] paged keys
    v_cache_ptr,  # [num_blocks, PAGE, HKV, D] paged values
    bt_ptr,  # [S, max_blocks] int32 block tables
    ctx_ptr,  # [N] int32 or int64 context length of each query row
    out_ptr,  # [N, HQ, D] output (SPLITS == 1) or [N, HQ, SPLITS, D] fp32 partial sums
    ml_ptr,  # [N, HQ, SPLITS, 2] fp32 partial (max, sum) in log2 units (SPLITS > 1)
    g_ptr,  # [N, HQ * D] output gate, rows g_stride apart (GATED, SPLITS == 1)
    q_stride,  # elements between rows of q
    g_stride,  # elements between rows of the gate
    row0,  # first query row of the tile
    n_rows,  # valid rows in the tile (<= BLOCK_Q); all belong to `seq`
    seq,  # sequence id of the tile's rows
    kvh,  # kv head
    split,  # which part of the key range this program covers
    HQ,  # query heads
    HKV,  # kv heads
    max_blocks,  # row stride of the block tables
    qk_scale,  # softmax scale * log2(e)
    G: tl.constexpr,  # query heads per kv head
    D: tl.constexpr,  # head dim
    PAGE: tl.constexpr,  # cache block size (rows per page)
    SPLITS: tl.constexpr,  # programs sharing a row's key range
    BLOCK_Q: tl.constexpr,  # query rows per tile
    BLOCK_G: tl.constexpr,  # next power of two >= G
    BLOCK_M: tl.constexpr,  # max(16, BLOCK_Q * BLOCK_G): rows of the score tile
    BLOCK_N: tl.constexpr,  # keys per iteration
    BLOCK_D: tl.constexpr,  # next power of two >= D
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored)
    GATED: tl.constexpr,  # the output scaled by sigmoid(gate)
):
    """Online-softmax attention of up to BLOCK_Q rows x G heads over one kv head."""
    m_idx = tl.arange(0, BLOCK_M)
    q_row = row0 + m_idx // BLOCK_G  # [BLOCK_M]
    g = m_idx % BLOCK_G
    row_ok = (m_idx // BLOCK_G < n_rows) & (g < G)
    head = kvh * G + g
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    qo_off = (q_row * HQ + head) * D  # [BLOCK_M] into out (contiguous)
    q = tl.load(
        q_ptr + (q_row * q_stride + head * D)[:, None] + dims[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    ctx = tl.load(ctx_ptr + q_row, mask=row_ok, other=0)  # [BLOCK_M]
    ctx_max = tl.max(ctx, axis=0)
    n_tiles = tl.cdiv(ctx_max, BLOCK_N)
    per_split = tl.cdiv(n_tiles, SPLITS)
    t_start = split * per_split
    t_end = tl.minimum(t_start + per_split, n_tiles)

    # A finite floor keeps fully masked rows free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * max_blocks
    for t in range(t_start, t_end):
        keys = t * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the sequence
        key_ok = keys < ctx_max
        blk = tl.load(bt_row + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        kv_off = (blk * PAGE + keys % PAGE) * (HKV * D) + kvh * D  # [BLOCK_N]
        kv_ptrs = kv_off[:, None] + dims[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(keys[None, :] < ctx[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        out = (acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
        if GATED:
            g_ptrs = g_ptr + (q_row * g_stride + head * D)[:, None] + dims[None, :]
            out = gated(out, g_ptrs, out_mask)
        tl.store(out_ptr + qo_off[:, None] + dims[None, :], out, mask=out_mask)
    else:
        part = (q_row * HQ + head) * SPLITS + split  # [BLOCK_M]
        tl.store(out_ptr + part[:, None] * D + dims[None, :], acc, mask=out_mask)
        tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [N, HQ, D] queries, rows q_stride elements apart
    k_cache_ptr,  # [num_blocks, PAGE, HKV, D] paged keys
    v_cache_ptr,  # [num_blocks, PAGE, HKV, D] paged values
    bt_ptr,  # [S, max_blocks] int32 block tables
    seq_ptr,  # [N] int32 sequence id of each query row
    ctx_ptr,  # [N] int32 or int64 context length of each query row
    out_ptr,  # [N, HQ, D] output, or [N, HQ, SPLITS, D] fp32 partial sums
    ml_ptr,  # [N, HQ, SPLITS, 2] fp32 partial (max, sum), unused when SPLITS == 1
    g_ptr,  # [N, HQ * D] output gate (GATED; applied by the merge when SPLITS > 1)
    q_stride,  # elements between rows of q
    g_stride,  # elements between rows of the gate
    N,  # query rows
    HQ,  # query heads
    HKV,  # kv heads
    max_blocks,  # row stride of the block tables
    qk_scale,  # softmax scale * log2(e)
    G: tl.constexpr,  # query heads per kv head
    D: tl.constexpr,  # head dim
    PAGE: tl.constexpr,  # cache block size
    SPLITS: tl.constexpr,  # programs sharing a row's key range
    BLOCK_Q: tl.constexpr,  # query rows per program
    BLOCK_G: tl.constexpr,  # next power of two >= G
    BLOCK_M_TILE: tl.constexpr,  # max(16, BLOCK_Q * BLOCK_G)
    BLOCK_M_ROW: tl.constexpr,  # max(16, BLOCK_G)
    BLOCK_N: tl.constexpr,  # keys per iteration
    BLOCK_D: tl.constexpr,  # next power of two >= D
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32"
    GATED: tl.constexpr,  # the output scaled by sigmoid(gate)
):
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_Q
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_rows = tl.minimum(N - row0, BLOCK_Q)
    if BLOCK_Q == 1:
        seq = tl.load(seq_ptr + row0)
        _attend(
            q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, out_ptr, ml_ptr, g_ptr,
            q_stride, g_stride, row0, 1, seq, kvh, split, HQ, HKV, max_blocks, qk_scale,
            G, D, PAGE, SPLITS, 1, BLOCK_G, BLOCK_M_ROW, BLOCK_N, BLOCK_D, DOT_PRECISION, GATED,
        )  # fmt: skip
    else:
        qi = tl.arange(0, BLOCK_Q)
        seqs = tl.load(seq_ptr + row0 + qi, mask=qi < n_rows, other=0)
        seq_min = tl.min(tl.where(qi < n_rows, seqs, 2147483647), axis=0)
        seq_max = tl.max(tl.where(qi < n_rows, seqs, -1), axis=0)
        if seq_min == seq_max:
            # All rows of the tile belong to one sequence: share every K/V tile.
            _attend(
                q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, out_ptr, ml_ptr, g_ptr,
                q_stride, g_stride, row0, n_rows, seq_min, kvh, split, HQ, HKV, max_blocks,
                qk_scale, G, D, PAGE, SPLITS, BLOCK_Q, BLOCK_G, BLOCK_M_TILE, BLOCK_N, BLOCK_D,
                DOT_PRECISION, GATED,
            )  # fmt: skip
        else:
            for r in range(n_rows):
                seq = tl.load(seq_ptr + row0 + r)
                _attend(
                    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, out_ptr, ml_ptr, g_ptr,
                    q_stride, g_stride, row0 + r, 1, seq, kvh, split, HQ, HKV, max_blocks, qk_scale,
                    G, D, PAGE, SPLITS, 1, BLOCK_G, BLOCK_M_ROW, BLOCK_N, BLOCK_D,
                    DOT_PRECISION, GATED,
                )  # fmt: skip


def _default_splits(device: torch.device, programs: int) -> int:
    """Split the key range only when the (rows x kv heads) programs leave SMs idle."""
    if device.type != "cuda":
        return 1
    sms = num_sms(device)
    if 2 * sms < programs <= 4 * sms:
        # Measured on an H200 (MiMo shape, bf16, CUDA graphs): batch 64 (512 programs)
        # takes 494 us at ctx 8192 and 134 us at ctx 2048 in 3 splits, against 567
        # and 145 us whole (a whole-context program holds 1 block per SM); batch 32
        # (256 programs) is fastest whole (249 us at ctx 8192, 269 in 4 splits).
        # Larger grids (prefill chunks) stay whole: their partial sums would cost more.
        return 3
    if programs >= sms:
        return 1
    # H200, MiMo shape, ctx 2048: batch 1 is fastest at 32 splits, batch 8 at 4-8.
    return min(_MAX_SPLITS, triton.cdiv(2 * sms, programs))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    rows_per_seq: int = 1,
    num_splits: int | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ([N, Hq, D]) over paged caches ([num_blocks, block_size, Hkv, D]).

    ``block_tables`` ([S, max_blocks] int32) maps a sequence's pages to cache blocks,
    ``seq_ids`` ([N] int32) gives each query row's sequence and ``context_lens`` ([N] int32
    or int64) how many of its cache rows it sees. ``q``'s rows may be strided (a view of
    a fused projection). Returns [N, Hq, D] in ``q.dtype``, contiguous.

    ``rows_per_seq`` is a performance hint only: how many consecutive rows typically share
    a sequence (1 for decode, the chunk length for a prefill chunk); results are the same
    for any value. ``num_splits`` overrides the split-K factor (None: pick from the GPU's SM
    count, so it depends on shapes only and suits CUDA graphs). With ``gate`` ([N, Hq * D],
    q's dtype, rows may be strided) the result is ``attention * sigmoid(gate)``.
    """
    return _paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_ids,
        context_lens,
        scale,
        rows_per_seq=rows_per_seq,
        num_splits=num_splits,
        gate=gate,
    )


def _paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    rows_per_seq: int = 1,
    num_splits: int | None = None,
    gate: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """``paged_attention`` with the launch configuration exposed (for benchmarks)."""
    check_rows("q", q, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_ids", seq_ids, 1, (torch.int32,))
    check_tensor("context_lens", context_lens, 1, (torch.int32, torch.int64))
    check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache)
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_ids=seq_ids,
        context_lens=context_lens,
    )
    n, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache's head dim must be q's ({d}), got {tuple(k_cache.shape)}")
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    check_shape("seq_ids", seq_ids, (n,))
    check_shape("context_lens", context_lens, (n,))
    if rows_per_seq < 1:
        raise ValueError(f"rows_per_seq must be >= 1, got {rows_per_seq}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    if gate is not None:
        check_rows("gate", gate, 2, FLOAT_DTYPES)
        check_shape("gate", gate, (n, hq * d))
        check_same_dtype(q=q, gate=gate)
        check_same_device(q=q, gate=gate)
    gate_arg, g_stride = (q, 0) if gate is None else (gate, gate.stride(0))
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out

    g = hq // hkv
    block_g = triton.next_power_of_2(g)
    block_q = min(triton.next_power_of_2(rows_per_seq), max(1, 64 // block_g))
    grid_rows = triton.cdiv(n, block_q)
    splits = num_splits or _default_splits(q.device, grid_rows * hkv)
    if splits == 1:
        part, ml = out, out  # ml is unused with one split
    else:
        part = torch.empty((n, hq, splits, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((n, hq, splits, 2), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    if block_n is None:
        # Measured on an H200 (bf16, D 128): 128-key tiles when a program walks a whole
        # context, 64 when the range is split; 3 stages if K and V tiles fit ~200 KB.
        block_n = 128 if splits == 1 and q.element_size() <= 2 and block_d <= 128 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_stages is None:
        num_stages = 3 if 2 * block_n * block_d * q.element_size() * 3 <= 200 * 1024 else 2
    _paged_attention_kernel[(grid_rows, hkv, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_ids,
        context_lens,
        part,
        ml,
        gate_arg,
        q.stride(0),
        g_stride,
        n,
        hq,
        hkv,
        block_tables.shape[1],
        float(scale) * _LOG2E,
        G=g,
        D=d,
        PAGE=page,
        SPLITS=splits,
        BLOCK_Q=block_q,
        BLOCK_G=block_g,
        BLOCK_M_TILE=max(16, block_q * block_g),
        BLOCK_M_ROW=max(16, block_g),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        GATED=gate is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        merge_attention_splits[(n * hq,)](
            part,
            ml,
            out,
            gate_arg,
            g_stride,
            hq,
            D=d,
            SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
            GATED=gate is not None,
            num_warps=1 if block_d <= 128 else 2,
        )
    return out
