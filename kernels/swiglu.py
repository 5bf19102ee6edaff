"""SwiGLU activation over a fused gate/up projection output.

``out = silu(gate) * up`` with ``gate = gate_up[:, :I]`` and ``up = gate_up[:, I:]``,
computed in fp32 and cast back to the input dtype. The grid is (rows, column tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES, check_tensor

__all__ = ["swiglu"]


@triton.jit
def _swiglu_kernel(
    gu_ptr,  # [N, 2I] gate (first I columns) and up (last I columns)
    out_ptr,  # [N, I] output, dtype of gate_up
    INTER,  # intermediate size I
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(gu_ptr + row * 2 * INTER + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * 2 * INTER + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * INTER + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up`` [N, 2I]; returns [N, I]."""
    check_tensor("gate_up", gate_up, 2, FLOAT_DTYPES)
    n, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate, up), got {two_i}")
    inter = two_i // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _swiglu_kernel[(n, triton.cdiv(inter, block))](
        gate_up, out, inter, BLOCK=block, num_warps=4 if block >= 512 else 1
    )
    return out
