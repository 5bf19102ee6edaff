"""RoPE tables: plain, and DeepSeek's YaRN (frequencies blended between extrapolation
and interpolation, cos and sin scaled by its mscale), as vLLM computes them.

A table is [max_positions, rotary_dim] in fp32: the cos columns then the sin columns,
computed in fp32 and rounded to the compute dtype (vLLM keeps its table in that dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Yarn:
    """rope_scaling of type yarn, as DeepSeek-V3 publishes it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The rotary dim whose wavelength turns `rotations` times over max_positions."""
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_freq(dim: int, theta: float, yarn: Yarn | None) -> torch.Tensor:
    """[dim / 2] fp32 inverse frequencies."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    plain = 1.0 / theta**exponents
    if yarn is None:
        return plain
    orig = yarn.original_max_position_embeddings
    low = max(math.floor(_correction_dim(yarn.beta_fast, dim, theta, orig)), 0)
    high = min(math.ceil(_correction_dim(yarn.beta_slow, dim, theta, orig)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
    keep = 1.0 - ramp.clamp(0, 1)  # 1: extrapolate (high frequencies), 0: interpolate
    return plain / yarn.factor * (1 - keep) + plain * keep


def rope_table(
    dim: int, theta: float, positions: int, dtype: torch.dtype, yarn: Yarn | None = None
) -> torch.Tensor:
    """[positions, dim]: cos columns then sin columns, fp32 (rounded to `dtype` first)."""
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq(dim, theta, yarn))
    scale = 1.0
    if yarn is not None:
        scale = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(
            yarn.factor, yarn.mscale_all_dim
        )
    table = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
    return table.to(dtype).float()
