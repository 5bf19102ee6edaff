"""swiglu against silu(gate) * up in torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtpdraft.kernels import swiglu


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@pytest.mark.parametrize("n,inter", [(1, 8), (7, 37), (3, 1500)])
def test_matches_reference(
    n: int, inter: int, dtype_tol: tuple[torch.dtype, float, float], device: torch.device
) -> None:
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(n + inter)
    gate_up = (torch.randn(n, 2 * inter, generator=gen) * 4).to(device, dtype)
    out = swiglu(gate_up)
    assert out.dtype == dtype and out.shape == (n, inter)
    torch.testing.assert_close(out.float(), swiglu_ref(gate_up).float(), atol=atol, rtol=rtol)


def test_large_negative_gate_gives_zero(device: torch.device) -> None:
    gate_up = torch.tensor([[-80.0, 0.0, 3.0, 5.0]], device=device)
    torch.testing.assert_close(swiglu(gate_up), torch.tensor([[0.0, 0.0]], device=device))


@pytest.mark.parametrize(
    "gate_up,match",
    [
        (torch.randn(3, 7), "must be even"),
        (torch.randn(8, 4).t(), "must be contiguous"),
        (torch.randn(8), "must be 2-D"),
    ],
)
def test_rejects_bad_arguments(gate_up: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        swiglu(gate_up)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64])
def test_gpu_mimo_shape(n: int) -> None:
    gate_up = torch.randn(n, 2 * 11008, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        swiglu(gate_up).float(), swiglu_ref(gate_up).float(), atol=2e-2, rtol=2e-2
    )
