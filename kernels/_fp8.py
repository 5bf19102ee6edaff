"""Block-scaled FP8 weight tiles, for the kernels that read FP8 weights (fused_moe, gemv).

A weight of float8_e4m3fn values comes with one fp32 scale per (SCALE_N rows x SCALE_K
columns) block, as DeepSeek-V3's checkpoints store them (``weight_scale_inv``).
"""

import triton
import triton.language as tl


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
