"""rms_norm, add_rms_norm and qk_norm against a plain torch RMSNorm."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.kernels import add_rms_norm, qk_norm, rms_norm


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


def _fused_projection(n, hq, hk, d, gated, dtype, device, seed):
    """A fused q [gate] k v projection output [N, ...] and its q, k views [N, heads, D]."""
    gen = torch.Generator().manual_seed(seed)
    widths = [hq * d, hq * d if gated else 0, hk * d, hk * d]
    qkv = (torch.randn(n, sum(widths), generator=gen) * 3).to(device, dtype)
    q, _, k, _ = qkv.split(widths, -1)
    return qkv, q.view(n, hq, d), k.view(n, hk, d)


def _qk_norm_ref(qkv, hq, hk, d, gated, wq, wk, unit_offset):
    """The same output, each head normed by rms_norm_ref; the gate and v untouched."""
    n, gate = qkv.shape[0], hq * d if gated else 0
    want = qkv.clone()
    for start, heads, w in ((0, hq, wq), (hq * d + gate, hk, wk)):
        part = want[:, start : start + heads * d]
        part.copy_(rms_norm_ref(part.reshape(n * heads, d), w, 1e-6, unit_offset).view(n, -1))
    return want


@pytest.mark.parametrize("n,hq,hk,d,gated", [(1, 4, 2, 32, True), (5, 8, 2, 24, False)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_qk_norm_normalizes_each_head_of_a_fused_projection_in_place(
    n: int, hq: int, hk: int, d: int, gated: bool, unit_offset: bool,
    dtype_tol: tuple[torch.dtype, float, float], device: torch.device,
) -> None:  # fmt: skip
    dtype, atol, rtol = dtype_tol
    qkv, q, k = _fused_projection(n, hq, hk, d, gated, dtype, device, seed=n * d)
    wq = (torch.rand(d) + 0.5).to(device, dtype)
    wk = (torch.rand(d) - 0.5).to(device, dtype)
    want = _qk_norm_ref(qkv, hq, hk, d, gated, wq, wk, unit_offset)
    qk_norm(q, k, wq, wk, 1e-6, unit_offset=unit_offset)
    torch.testing.assert_close(qkv.float(), want.float(), atol=atol, rtol=rtol)


def test_qk_norm_rejects_bad_arguments() -> None:
    q, k, w = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="k must be"):
        qk_norm(q, torch.randn(2, 2, 4), w, w, 1e-6)
    with pytest.raises(ValueError, match="q_weight must have shape"):
        qk_norm(q, k, torch.ones(4), w, 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        qk_norm(q.transpose(1, 2), torch.randn(2, 8, 2).transpose(1, 2), w, w, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64])
def test_gpu_qk_norm_qwen3_next_shape(n: int) -> None:
    """Qwen3-Next: 16 q heads with their gates, 2 kv heads, head dim 256, (1 + w) scales."""
    qkv, q, k = _fused_projection(n, 16, 2, 256, True, torch.bfloat16, "cuda", seed=n)
    wq, wk = (torch.randn(256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want = _qk_norm_ref(qkv, 16, 2, 256, True, wq, wk, True)
    qk_norm(q, k, wq, wk, 1e-6, unit_offset=True)
    torch.testing.assert_close(qkv.float(), want.float(), atol=2e-2, rtol=2e-2)
