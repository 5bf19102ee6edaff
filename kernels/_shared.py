"""The pieces more than one kernel is built from, kept here so that no kernel imports
another's private names (the launchers' argument checks are ``_checks``).

- ``num_sms``: the GPU's SM count, by which split launches size their grids.
- ``INT32_MAX``: the "no index" of the argmax reductions.
- ``row_warps``, ``rms_norm_row``: a program holding a whole row, and its RMSNorm (rms_norm,
  add_rms_norm, qk_norm, mtp_input_norms).
- ``scale_tiles``, ``dequantize_tile``: block-scaled FP8 weight tiles (gemv, fused_moe). A
  weight of float8_e4m3fn values comes with one fp32 scale per (SCALE_N rows x SCALE_K
  columns) block, as DeepSeek-V3's checkpoints store them (``weight_scale_inv``).
- ``gemv_tile``, ``gemv_config``, ``check_gemv_args``: a few rows against a large weight
  (gemv, and lm_head_drafts, the LM head fused with the draft selection).
- ``merge_draft_splits``: the (argmax, max, sum) partials of rows split over programs
  (select_drafts, lm_head_drafts).
- ``needs_min_p_mass``: which sampled rows' top-p needs the whole vocabulary's kept mass
  (top_support sums it, sample_top reads it).
- ``merge_attention_splits``, ``gated``: flash-decoding partials of attention
  (paged_attention; mla_decode over the latent width), and an output gate applied as the
  output is written.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_same_device, check_same_dtype, check_tensor

INT32_MAX = tl.constexpr(2147483647)


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def needs_min_p_mass(row, temp_ptr, top_k_ptr, top_p_ptr):
    """A sampled row (temperature > 0) with no top-k cut and a top-p below 1: its top-p
    divides by the mass min-p keeps of the whole vocabulary, not of its support."""
    t = tl.load(temp_ptr + row)
    return (t > 0) & (tl.load(top_k_ptr + row) <= 0) & (tl.load(top_p_ptr + row) < 1)


# --- a whole row in one program --------------------------------------------------------


def row_warps(block_h: int) -> int:
    """Warps for one program holding a whole row of ``block_h`` columns: one per 512
    columns (16 values a lane), from 1 to 16."""
    return min(max(block_h // 512, 1), 16)


@triton.jit
def rms_norm_row(
    x,  # [BLOCK_H] fp32 row, zero beyond H
    w_ptr,  # [H] scale
    cols,  # [BLOCK_H] column indices
    mask,  # [BLOCK_H] cols < H
    H,  # hidden size
    eps,  # variance epsilon
    UNIT_OFFSET: tl.constexpr,  # scale by (1 + w) instead of w
):
    """Return the normalized, scaled fp32 row."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = w + 1.0
    return x * rstd * w


# --- block-scaled FP8 weight tiles -------------------------------------------------------


def scale_tiles(block_k: int, scale_k: int) -> tuple[int, bool]:
    """(K tile, SCALE_TILE) for weights with scale blocks of ``scale_k`` columns: the tile
    cut to divide scale_k (powers of two up to its largest power-of-two divisor do), so a
    tile row needs one scale, where that leaves 16 or more; else the tile as it was, each
    element looking up its own scale."""
    divisor = scale_k & -scale_k
    if divisor < 16:
        return block_k, False
    return min(block_k, divisor), True


@triton.jit
def dequantize_tile(w, s_ptrs, k, rk, n_ok, k_ok, SCALE_K: tl.constexpr, SCALE_TILE: tl.constexpr):
    """An FP8 tile [BLOCK_N, BLOCK_K] at columns k + rk, in fp32, times its blocks' scales.

    ``s_ptrs`` [BLOCK_N] points at each tile row's row of scales. Where the K tile lies in
    one scale block (SCALE_TILE) a row needs one scale; else each column picks its own.
    """
    if SCALE_TILE:
        s = tl.load(s_ptrs + k // SCALE_K, mask=n_ok, other=0.0)
        w = w.to(tl.float32) * s[:, None]
    else:
        s = tl.load(
            s_ptrs[:, None] + ((k + rk) // SCALE_K)[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = w.to(tl.float32) * s
    return w


# --- a few rows against a large weight ------------------------------------------------

GEMV_MAX_ROWS = 64
# Shared memory for the x and w tiles in flight (Hopper has 227 KB a block): one set a
# pipeline stage with 64-row tiles (wgmma reads its operands there), one fewer below.
SHARED_BYTES = 200 * 1024


@triton.jit
def gemv_tile(
    x_ptr,  # [M, K] input rows
    w_ptr,  # [N, K] weight
    M,  # rows of x
    N,  # rows of w
    K,  # inner dimension
    pid,  # which BLOCK_N rows of w
    s_ptr,  # [ceil(N / SCALE_N), ceil(K / SCALE_K)] fp32 scales (FP8 only)
    FP8: tl.constexpr,  # w is float8_e4m3fn
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_TILE: tl.constexpr,  # SCALE_K % BLOCK_K == 0: one scale per row and K tile
    BLOCK_M: tl.constexpr,  # >= M, >= 16
    BLOCK_N: tl.constexpr,  # weight rows per program
    BLOCK_K: tl.constexpr,  # inner tile
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (ignored)
):
    """[BLOCK_M, BLOCK_N] fp32: x @ w[pid * BLOCK_N : (pid + 1) * BLOCK_N].T (gemv.py)."""
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
    s_ptrs = s_ptr + (rn // SCALE_N) * tl.cdiv(K, SCALE_K)  # each row's row of scales
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + rk) < K
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8:
            w = dequantize_tile(w, s_ptrs, k, rk, n_ok, k_ok, SCALE_K, SCALE_TILE).to(x.dtype)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


def gemv_config(m: int, n: int, k: int, dtype: torch.dtype, fp8: bool = False) -> dict[str, object]:
    """Launch constants, measured best on an H200 (bf16, one row, each shape in a CUDA graph).

    o_proj [4096, 4096]: 32 x 512 tiles, 8.3 us (cuBLAS 10.5); q/k/v [6144, 4096]:
    64 x 512, 13.0 us (13.8); gate/up [22016, 4096]: 64 x 512, 46.3 us (46.9); the
    LM head [151680, 4096] with the draft selection: 64 x 256, 281 us (cuBLAS + the
    selection 302); all with 3 pipeline stages. More rows halve the K tile so the
    stages still fit in shared memory (at 32 rows: 293 us for the LM head, 4 stages).
    """
    block_m = max(16, triton.next_power_of_2(m))
    stages = 3
    if n > 65536:
        block_n, block_k = 64, 256
    elif n > 4096 and k <= 2048 and not fp8:
        # A short K gives each program few tiles to pipeline: more, thinner programs
        # (measured with 16-bit weights, Qwen3-Next's fused q/gate/k/v: bench/results/gemv.md).
        block_n, block_k, stages = 32, 128, 4
    elif n > 4096:
        block_n, block_k = 64, 512
    elif n <= 1024 and not fp8:  # a router's few rows (measured as above): more programs
        block_n, block_k = 16, 512
    else:
        block_n, block_k = 32, 512
    if dtype == torch.float32 or block_m > 16:
        block_k, stages = block_k // 2, 4
    buffers = stages if block_m >= 64 else stages - 1
    while buffers * (block_m + block_n) * block_k * torch.finfo(dtype).bits // 8 > SHARED_BYTES:
        block_k //= 2
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "num_warps": 4,
        "num_stages": stages,
    }


def check_gemv_args(x: torch.Tensor, weight: torch.Tensor, fp8: bool = False) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 2, (torch.float8_e4m3fn,) if fp8 else FLOAT_DTYPES)
    if not fp8:
        check_same_dtype(x=x, weight=weight)
    check_same_device(x=x, weight=weight)
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if x.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"x may have at most {GEMV_MAX_ROWS} rows, got {x.shape[0]}")


# --- merges of a row's partials, split over programs ----------------------------------


@triton.jit
def merge_draft_splits(
    part_idx_ptr,  # [N, SPLITS] int32 partial argmax, -1 if the part allows nothing
    part_ms_ptr,  # [N, SPLITS, 2] fp32 partial (max, sum of exp(l - max))
    tok_ptr,  # [N] int64 output token, -1 if none allowed
    prob_ptr,  # [N] fp32 output probability
    SPLITS: tl.constexpr,  # parts per row, in increasing token order
    BLOCK_S: tl.constexpr,  # next power of two >= SPLITS
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < SPLITS
    idx = tl.load(part_idx_ptr + row * SPLITS + sp, mask=s_ok, other=-1)
    m = tl.load(part_ms_ptr + (row * SPLITS + sp) * 2, mask=s_ok, other=float("-inf"))
    s = tl.load(part_ms_ptr + (row * SPLITS + sp) * 2 + 1, mask=s_ok, other=0.0)
    valid = idx >= 0
    m_all = tl.max(tl.where(valid, m, float("-inf")), axis=0)
    # Parts cover increasing token ranges: the lowest index among the maxima wins ties.
    winner = tl.min(tl.where(valid & (m == m_all), idx, INT32_MAX), axis=0)
    token = tl.where(winner == INT32_MAX, -1, winner)
    ref = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.sum(tl.where(s > 0.0, s * tl.exp(m - ref), 0.0), axis=0)
    tl.store(tok_ptr + row, token.to(tl.int64))
    tl.store(prob_ptr + row, 1.0 / tl.where(total > 0.0, total, float("inf")))


@triton.jit
def gated(out, g_ptrs, mask):
    """out * sigmoid(gate) in out's dtype, each factor rounded to it first (as torch does)."""
    gate = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    factor = tl.sigmoid(gate).to(out.dtype).to(tl.float32)
    return (out.to(tl.float32) * factor).to(out.dtype)


@triton.jit
def merge_attention_splits(
    part_ptr,  # [N, HQ, SPLITS, D] fp32 partial sums of p * v
    ml_ptr,  # [N, HQ, SPLITS, 2] fp32 partial (max, sum of p), log2 units
    out_ptr,  # [N, HQ, D] output
    g_ptr,  # [N, HQ * D] output gate, rows g_stride apart (GATED only)
    g_stride,
    HQ,  # heads
    D: tl.constexpr,  # head dim
    SPLITS: tl.constexpr,  # number of partials per (row, head)
    BLOCK_S: tl.constexpr,  # next power of two >= SPLITS
    BLOCK_D: tl.constexpr,  # next power of two >= D
    GATED: tl.constexpr,  # the output scaled by sigmoid(gate)
):
    rh = tl.program_id(0).to(tl.int64)  # row * HQ + head
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < SPLITS
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    m = tl.load(ml_ptr + (rh * SPLITS + sp) * 2, mask=s_ok, other=-1.0e30)
    l_s = tl.load(ml_ptr + (rh * SPLITS + sp) * 2 + 1, mask=s_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    den = tl.sum(w * l_s, axis=0)
    part = tl.load(
        part_ptr + (rh * SPLITS + sp)[:, None] * D + dims[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    out = out.to(out_ptr.dtype.element_ty)
    if GATED:
        out = gated(out, g_ptr + (rh // HQ) * g_stride + (rh % HQ) * D + dims, d_ok)
    tl.store(out_ptr + rh * D + dims, out, mask=d_ok)
