"""``y = x @ w.T (+ bias)`` for a few rows x ([M, K], M <= 64) against a large weight ([N, K]).

At decode batch sizes a matrix product reads the whole weight to produce a few
rows: it is bound by memory bandwidth. One program streams BLOCK_N rows of the
weight through all of K (tiles of BLOCK_K, software-pipelined) and multiplies them
with the x rows it holds, padded to at least 16 for the tensor cores. Measured on
an H200 (bf16, one row, the MiMo-7B MTP layer's shapes): 2-21% less time than
cuBLAS's choice for each matrix (see gemv_config).

``_gemv_tile`` is the per-program body, shared with the LM head's fused draft
selection (lm_head_drafts).

A block-scaled FP8 weight (DeepSeek-V3's, ``weight_scale`` per ``scale_block``) is read as
FP8, half the bytes of bf16: each tile is converted and scaled (``_fp8``) and rounded to
x's dtype before its product, so the result is the one on the weight dequantized that way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_same_device, check_same_dtype, check_shape, check_tensor
from ._fp8 import dequantize_tile, scale_tiles

__all__ = ["gemv", "gemv_config"]

MAX_ROWS = 64
# Shared memory for the x and w tiles in flight (Hopper has 227 KB a block): one set a
# pipeline stage with 64-row tiles (wgmma reads its operands there), one fewer below.
SHARED_BYTES = 200 * 1024


@triton.jit
def _gemv_tile(
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
    """[BLOCK_M, BLOCK_N] fp32: x @ w[pid * BLOCK_N : (pid + 1) * BLOCK_N].T."""
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


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] bias (unused without HAS_BIAS)
    s_ptr,  # FP8 scales (unused without FP8)
    y_ptr,  # [M, N] output, dtype of x
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    SCALE_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    acc = _gemv_tile(
        x_ptr, w_ptr, M, N, K, pid, s_ptr, FP8, SCALE_N, SCALE_K, SCALE_TILE, BLOCK_M, BLOCK_N,
        BLOCK_K, DOT_PRECISION,
    )  # fmt: skip
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & n_ok[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


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
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x may have at most {MAX_ROWS} rows, got {x.shape[0]}")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [M, K] (M <= 64), weight [N, K], bias [N]; returns [M, N].

    With ``weight_scale`` (fp32 [ceil(N / bn), ceil(K / bk)], (bn, bk) = ``scale_block``):
    weight is float8_e4m3fn and ``weight[r, c] * weight_scale[r // bn, c // bk]`` its value.
    """
    fp8 = weight_scale is not None
    check_gemv_args(x, weight, fp8)
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES)
        check_shape("bias", bias, (n,))
        check_same_device(x=x, bias=bias)
    scale_n, scale_k = scale_block if fp8 else (1, 1)
    if fp8:
        check_tensor("weight_scale", weight_scale, 2, (torch.float32,))
        check_shape("weight_scale", weight_scale, (-(-n // scale_n), -(-k // scale_k)))
        check_same_device(x=x, weight_scale=weight_scale)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = gemv_config(m, n, k, x.dtype, fp8)
    scale_tile = False
    if fp8:
        cfg["BLOCK_K"], scale_tile = scale_tiles(cfg["BLOCK_K"], scale_k)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, weight if bias is None else bias, weight_scale if fp8 else x, y, m, n, k,
        HAS_BIAS=bias is not None, FP8=fp8, SCALE_N=scale_n, SCALE_K=scale_k,
        SCALE_TILE=scale_tile, **cfg,
    )  # fmt: skip
    return y
