"""``y = x @ w.T (+ bias)`` for a few rows x ([M, K], M <= 64) against a large weight ([N, K]).

At decode batch sizes a matrix product reads the whole weight to produce a few
rows: it is bound by memory bandwidth. One program streams BLOCK_N rows of the
weight through all of K (tiles of BLOCK_K, software-pipelined) and multiplies them
with the x rows it holds, padded to at least 16 for the tensor cores. Measured on
an H200 (bf16, one row, the MiMo-7B MTP layer's shapes): 2-21% less time than
cuBLAS's choice for each matrix (see gemv_config).

The per-program body (``gemv_tile``) and the launch constants (``gemv_config``) are in
``_shared``: the LM head's fused draft selection (lm_head_drafts) is built from them too.

A block-scaled FP8 weight (DeepSeek-V3's, ``weight_scale`` per ``scale_block``) is read as
FP8, half the bytes of bf16: each tile is converted and scaled and rounded to x's dtype
before its product, so the result is the one on the weight dequantized that way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_same_device, check_shape, check_tensor
from ._shared import check_gemv_args, gemv_config, gemv_tile, scale_tiles

__all__ = ["gemv"]


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
    acc = gemv_tile(
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
