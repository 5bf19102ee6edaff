"""rms_norm against a plain torch RMSNorm."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.kernels import add_rms_norm, rms_norm


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if unit_offset else weight.float()
    return (y * w).to(x.dtype)


@pytest.mark.parametrize("n,h", [(1, 64), (7, 100), (3, 1000), (2, 4096)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_matches_reference(
    n: int,
    h: int,
    unit_offset: bool,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(n * h)
    x = (torch.randn(n, h, generator=gen) * 3).to(device, dtype)
    w = (torch.rand(h, generator=gen) + 0.5).to(device, dtype)
    y = rms_norm(x, w, 1e-6, unit_offset=unit_offset)
    assert y.dtype == dtype and y.shape == (n, h)
    torch.testing.assert_close(
        y.float(), rms_norm_ref(x, w, 1e-6, unit_offset).float(), atol=atol, rtol=rtol
    )


def test_fp32_weight_with_bf16_input(device: torch.device) -> None:
    x = torch.randn(5, 96).to(device, torch.bfloat16)
    w = torch.randn(96).to(device)
    y = rms_norm(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), rms_norm_ref(x, w, 1e-5).float(), atol=2e-2, rtol=2e-2)


def test_empty_batch(device: torch.device) -> None:
    y = rms_norm(torch.empty(0, 32, device=device), torch.ones(32, device=device), 1e-6)
    assert y.shape == (0, 32)


@pytest.mark.parametrize(
    "x,w,match",
    [
        (torch.randn(4, 8), torch.ones(7), "weight must have shape"),
        (torch.randn(8, 4).t(), torch.ones(8), "x must be contiguous"),
        (torch.randn(2, 4, 8), torch.ones(8), "x must be 2-D"),
        (torch.ones(4, 8, dtype=torch.int32), torch.ones(8), "x must have dtype"),
    ],
)
def test_rejects_bad_arguments(x: torch.Tensor, w: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rms_norm(x, w, 1e-6)


@pytest.mark.parametrize("n,h", [(1, 64), (5, 100)])
def test_add_rms_norm_adds_in_place_then_normalizes(
    n: int, h: int, dtype_tol: tuple[torch.dtype, float, float], device: torch.device
) -> None:
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(n + h)
    x = torch.randn(n, h, generator=gen).to(device, dtype)
    delta = torch.randn(n, h, generator=gen).to(device, dtype)
    w = (torch.rand(h, generator=gen) + 0.5).to(device, dtype)
    total = x + delta  # rounded to dtype, as the unfused add
    y = add_rms_norm(x, delta, w, 1e-6)
    # Within rounding of the add (the interpreter rounds bf16 toward zero, GPUs to nearest).
    torch.testing.assert_close(x.float(), total.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(
        y.float(), rms_norm_ref(total, w, 1e-6).float(), atol=atol, rtol=rtol
    )


def test_add_rms_norm_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="delta must have shape"):
        add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_gpu_mimo_shape(n: int, unit_offset: bool) -> None:
    x = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    y = rms_norm(x, w, 1e-6, unit_offset=unit_offset)
    ref = rms_norm_ref(x, w, 1e-6, unit_offset)
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
