"""DeepSeek-V3 multi-head latent attention (MLA) over a paged latent cache, absorbed form.

The cache holds, per token, only the compressed latent c (kv_lora_rank R values, already
RMS-normed) and the rotated k_pe (qk_rope_head_dim P values): ``latent`` is
[num_blocks, block_size, R + P], c in the first R columns and k_pe in the last P. In the
absorbed form the caller has folded W_UK into the query (``q_latent[h] = q_nope[h] @
W_UK[h]``, R values per head) and applies W_UV to the output, so for query row i and head h

    score[h, t] = scale * (q_latent[h] . c[t] + q_pe[h] . k_pe[t]),   t < context_lens[i]
    out[h]      = softmax_t(score[h]) @ c                              (R values)

over the cache rows of sequence ``seq_ids[i]`` (pages ``block_tables[seq_ids[i]]``). Every
head reads the same cache row (MQA over the latent), and c serves as both key and value.
Causal chunks need no mask: each row carries its own context length, so one sequence may
appear on several rows.

A program handles one query row, ``BLOCK_H`` of its heads (the heads form the M side of
the tensor-core tiles, as in SGLang's grouped decode kernel and FlashMLA) and one of
``SPLITS`` parts of the context: each [BLOCK_N, R] latent tile and [BLOCK_N, P] k_pe tile it
loads serves all BLOCK_H heads, for both the scores and the output. R + P (576) is not a
power of two, so the two parts are separate tiles and two dots. Keys are walked in tiles of
``BLOCK_N`` with an online softmax in fp32; the [BLOCK_H, R] accumulator stays in
registers, which is why R is capped at 512 and P at 64. When rows x head blocks leave SMs
idle (small batch, long context), the context is split (flash-decoding) and a second kernel
merges the fp32 partials. The grid depends on shapes only, never on context lengths, so the
launch is CUDA-graph capturable; a split whose part of a short context is empty writes a
neutral partial.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    FLOAT_DTYPES,
    check_kind,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from ._shared import merge_attention_splits, num_sms

__all__ = ["mla_decode"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
_MAX_R = 512
_MAX_P = 64


@triton.jit
def _mla_decode_kernel(
    ql_ptr,  # [N, H, R] q_latent, strides (ql_s0, ql_s1, 1)
    qp_ptr,  # [N, H, P] q_pe, strides (qp_s0, qp_s1, 1)
    latent_ptr,  # [num_blocks, PAGE, R + P] paged latent cache
    bt_ptr,  # [S, max_blocks] int32 block tables
    seq_ptr,  # [N] int32 sequence id of each row
    ctx_ptr,  # [N] int32 or int64 context length of each row
    out_ptr,  # [N, H, R] output (SPLITS == 1) or [N, H, SPLITS, R] fp32 partial sums
    ml_ptr,  # [N, H, SPLITS, 2] fp32 partial (max, sum) in log2 units (SPLITS > 1)
    ql_s0,  # elements between rows of q_latent
    ql_s1,  # elements between heads of q_latent
    qp_s0,  # elements between rows of q_pe
    qp_s1,  # elements between heads of q_pe
    H,  # heads
    max_blocks,  # row stride of the block tables
    qk_scale,  # softmax scale * log2(e)
    R: tl.constexpr,  # latent width (kv_lora_rank)
    P: tl.constexpr,  # rotary width (qk_rope_head_dim)
    PAGE: tl.constexpr,  # cache block size
    SPLITS: tl.constexpr,  # programs sharing a row's context
    BLOCK_H: tl.constexpr,  # heads per program (>= 16)
    BLOCK_N: tl.constexpr,  # keys per iteration
    BLOCK_R: tl.constexpr,  # max(16, next power of two >= R)
    BLOCK_P: tl.constexpr,  # max(16, next power of two >= P)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored)
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < H
    rd = tl.arange(0, BLOCK_R)
    pd = tl.arange(0, BLOCK_P)
    r_ok = rd < R
    p_ok = pd < P

    q_lat = tl.load(
        ql_ptr + row * ql_s0 + heads[:, None] * ql_s1 + rd[None, :],
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(
        qp_ptr + row * qp_s0 + heads[:, None] * qp_s1 + pd[None, :],
        mask=h_ok[:, None] & p_ok[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_P]

    seq = tl.load(seq_ptr + row).to(tl.int64)
    ctx = tl.load(ctx_ptr + row)
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(n_tiles, SPLITS)
    t_start = split * per_split
    t_end = tl.minimum(t_start + per_split, n_tiles)

    # A finite floor keeps rows with no keys (or empty splits) free of inf - inf.
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    bt_row = bt_ptr + seq * max_blocks
    for t in range(t_start, t_end):
        keys = t * BLOCK_N + tl.arange(0, BLOCK_N)  # positions in the sequence
        key_ok = keys < ctx
        blk = tl.load(bt_row + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        tok = latent_ptr + (blk * PAGE + keys % PAGE) * (R + P)  # [BLOCK_N] cache rows
        c = tl.load(
            tok[:, None] + rd[None, :], mask=key_ok[:, None] & r_ok[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_R]: the keys' latent part and the values
        k_pe = tl.load(
            tok[:, None] + R + pd[None, :], mask=key_ok[:, None] & p_ok[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_P]
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=DOT_PRECISION)
        s = tl.where(key_ok[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = h_ok[:, None] & r_ok[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + (row * H + heads)[:, None] * R + rd[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (row * H + heads) * SPLITS + split  # [BLOCK_H]
        tl.store(out_ptr + part[:, None] * R + rd[None, :], acc, mask=out_mask)
        tl.store(ml_ptr + part * 2, m_i, mask=h_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=h_ok)


def _default_splits(device: torch.device, programs: int) -> int:
    """Split the context only when the (rows x head blocks) programs leave SMs idle.

    Aims at about two programs per SM. Not measured yet for this kernel (no GPU time when
    it was written); DeepSeek-V3's 128 heads make 8 head blocks per row, so batch 1 gets
    32 splits and batch >= 17 on an H100 (132 SMs) none.
    """
    if device.type != "cuda":
        return 1
    sms = num_sms(device)
    if programs >= sms:
        return 1
    return min(_MAX_SPLITS, triton.cdiv(2 * sms, programs))


def _check_heads(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> None:
    """Require a 3-D [rows, heads, dim] tensor whose last dim is contiguous.

    Rows and heads may sit at any stride: q_latent is often a transposed [H, N, R] batched
    matmul output, q_pe a column slice of the query projection.
    """
    t = check_kind(name, t, 3, dtypes)
    if t.shape[2] > 1 and t.stride(2) != 1:
        raise ValueError(f"{name}'s last dim must be contiguous, got strides {t.stride()}")


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of [N, H, R] ``q_latent`` and [N, H, P] ``q_pe`` over ``latent``.

    ``latent`` is the paged cache [num_blocks, block_size, R + P] (c, then k_pe),
    ``block_tables`` ([S, max_blocks] int32) maps a sequence's pages to cache blocks,
    ``seq_ids`` ([N] int32) gives each row's sequence and ``context_lens`` ([N] int32 or
    int64) how many of its cache rows it sees (0 gives zeros). The queries' rows and heads
    may be strided; their last dim must be contiguous. ``scale`` is the softmax scale of
    the full head dim (DeepSeek: (qk_nope + qk_rope)^-0.5, times the YaRN mscale^2).
    Returns the latent output [N, H, R] in the queries' dtype, contiguous; the caller
    applies W_UV. ``num_splits`` overrides the split-K factor (None: from the GPU's SM
    count and the shapes, so it suits CUDA graphs).
    """
    return _mla_decode(
        q_latent,
        q_pe,
        latent,
        block_tables,
        seq_ids,
        context_lens,
        scale,
        num_splits=num_splits,
    )


def _mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """``mla_decode`` with the launch configuration exposed (for benchmarks)."""
    _check_heads("q_latent", q_latent, FLOAT_DTYPES)
    _check_heads("q_pe", q_pe, FLOAT_DTYPES)
    check_tensor("latent", latent, 3, FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_ids", seq_ids, 1, (torch.int32,))
    check_tensor("context_lens", context_lens, 1, (torch.int32, torch.int64))
    check_same_dtype(q_latent=q_latent, q_pe=q_pe, latent=latent)
    check_same_device(
        q_latent=q_latent,
        q_pe=q_pe,
        latent=latent,
        block_tables=block_tables,
        seq_ids=seq_ids,
        context_lens=context_lens,
    )
    n, h, r = q_latent.shape
    p = q_pe.shape[2]
    if h == 0:
        raise ValueError(f"q_latent must have at least one head, got {tuple(q_latent.shape)}")
    if not 0 < r <= _MAX_R:
        raise ValueError(f"q_latent's width (kv_lora_rank) must be in [1, {_MAX_R}], got {r}")
    if not 0 < p <= _MAX_P:
        raise ValueError(f"q_pe's width (qk_rope_head_dim) must be in [1, {_MAX_P}], got {p}")
    check_shape("q_pe", q_pe, (n, h, p))
    if latent.shape[2] != r + p:
        raise ValueError(
            f"latent must have shape [num_blocks, block_size, {r} + {p}], got {tuple(latent.shape)}"
        )
    check_shape("seq_ids", seq_ids, (n,))
    check_shape("context_lens", context_lens, (n,))
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    out = torch.empty((n, h, r), dtype=q_latent.dtype, device=q_latent.device)
    if n == 0:
        return out

    block_r = max(16, triton.next_power_of_2(r))
    block_p = max(16, triton.next_power_of_2(p))
    if block_h is None:
        # The [BLOCK_H, R] fp32 accumulator and the [BLOCK_H, R] query live in registers:
        # 16 heads at R 512 (as SGLang's grouped MLA decode kernel uses) is 64 + 32
        # registers a thread at 4 warps.
        block_h = 16 if block_r >= 256 else 32
    block_h = max(16, min(block_h, triton.next_power_of_2(h)))
    if block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two, got {block_h}")
    if block_n is None:
        # Two stages of [32, 512] + [32, 64] bf16 tiles: 72 KB of shared memory.
        block_n = 32 if block_r >= 256 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    head_blocks = triton.cdiv(h, block_h)
    splits = num_splits or _default_splits(q_latent.device, n * head_blocks)
    if splits == 1:
        part, ml = out, out  # ml is unused with one split
    else:
        part = torch.empty((n, h, splits, r), dtype=torch.float32, device=q_latent.device)
        ml = torch.empty((n, h, splits, 2), dtype=torch.float32, device=q_latent.device)
    _mla_decode_kernel[(n, head_blocks, splits)](
        q_latent,
        q_pe,
        latent,
        block_tables,
        seq_ids,
        context_lens,
        part,
        ml,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        h,
        block_tables.shape[1],
        float(scale) * _LOG2E,
        R=r,
        P=p,
        PAGE=latent.shape[1],
        SPLITS=splits,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_P=block_p,
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        merge_attention_splits[(n * h,)](  # the attention merge, over the latent width
            part,
            ml,
            out,
            out,  # no gate
            0,
            h,
            D=r,
            SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=triton.next_power_of_2(r),
            GATED=False,
            num_warps=4 if r > 128 else 1,
        )
    return out
