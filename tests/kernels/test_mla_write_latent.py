"""mla_write_latent and rope_interleaved against an explicit interleaved rotation in torch."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.kernels import mla_write_latent, rope_interleaved


def make_cos_sin(max_pos: int, rot: int, theta: float = 10000.0) -> torch.Tensor:
    """[max_pos, rot] fp32: rot/2 cos columns, then rot/2 sin columns."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def rope_interleaved_ref(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) rotated by angle i, written out pair by pair (float64)."""
    half = cos_sin.shape[1] // 2
    cs = cos_sin[positions.long()].double()  # [N, P]
    xd = x.double()
    out = torch.empty_like(xd)
    for i in range(half):
        cos = cs[:, i].reshape(-1, *([1] * (x.dim() - 2)))
        sin = cs[:, half + i].reshape(-1, *([1] * (x.dim() - 2)))
        even, odd = xd[..., 2 * i], xd[..., 2 * i + 1]
        out[..., 2 * i] = even * cos - odd * sin
        out[..., 2 * i + 1] = odd * cos + even * sin
    return out


def rope_complex_ref(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """DeepSeek's own form: adjacent pairs as complex numbers times exp(i * pos * freq)."""
    p = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, p, 2, dtype=torch.float64) / p)
    angles = torch.outer(positions.double().cpu(), freqs)  # [N, P/2]
    rot = torch.polar(torch.ones_like(angles), angles)
    if x.dim() == 3:
        rot = rot[:, None, :]
    xc = torch.view_as_complex(x.double().cpu().reshape(*x.shape[:-1], p // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2)


def write_latent_ref(
    c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    latent: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The cache after the write, in float64."""
    out = latent.double().clone()
    flat = out.view(-1, out.shape[2])
    rows = torch.cat([c.double(), rope_interleaved_ref(k_pe, positions, cos_sin)], dim=-1)
    keep = slots >= 0
    flat[slots[keep]] = rows[keep]
    return out


@pytest.mark.parametrize(
    "n,r,p,block_size",
    [
        (1, 32, 8, 4),  # the small test size
        (7, 24, 6, 3),  # widths and block size not powers of two
        (5, 48, 16, 8),
    ],
)
def test_write_matches_reference(
    n: int,
    r: int,
    p: int,
    block_size: int,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    """c and k_pe as slices of one kv_a output; a padding slot; other slots untouched."""
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(n * r + p)
    max_pos, num_blocks = 64, 6
    kv_a = torch.randn(n, r + p, generator=gen).to(device, dtype)
    c, k_pe = kv_a[:, :r], kv_a[:, r:]
    kv_a_before = kv_a.clone()
    positions = torch.randint(0, max_pos, (n,), generator=gen).to(device)
    cos_sin = make_cos_sin(max_pos, p).to(device)
    latent = torch.randn(num_blocks, block_size, r + p, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    if n > 2:
        slots[1] = -1  # a padding row: nothing written
    slots = slots.to(device)
    expected = write_latent_ref(c, k_pe, positions, cos_sin, latent, slots)
    mla_write_latent(c, k_pe, positions, cos_sin, latent, slots)
    torch.testing.assert_close(latent.double(), expected, atol=atol, rtol=rtol)
    keep = slots >= 0
    assert torch.equal(latent.view(-1, r + p)[slots[keep], :r], c[keep])  # c copied exactly
    assert torch.equal(kv_a, kv_a_before)  # inputs only read


def test_interleaved_is_deepseeks_complex_rotation(device: torch.device) -> None:
    """The written k_pe is DeepSeek's complex-pair rotation, not the rotate_half one."""
    gen = torch.Generator().manual_seed(9)
    n, r, p, theta = 4, 16, 8, 10000.0
    c = torch.randn(n, r, generator=gen).to(device)
    k_pe = torch.randn(n, p, generator=gen).to(device)
    positions = torch.tensor([0, 1, 7, 30], device=device)
    latent = torch.zeros(2, 4, r + p, device=device)
    slots = torch.tensor([5, 0, 7, 2], device=device)
    mla_write_latent(c, k_pe, positions, make_cos_sin(32, p, theta).to(device), latent, slots)
    written = latent.view(-1, r + p)[slots, r:].double().cpu()
    expected = rope_complex_ref(k_pe, positions, theta)
    torch.testing.assert_close(written, expected, atol=1e-5, rtol=1e-5)
    x1, x2 = k_pe[:, : p // 2].double().cpu(), k_pe[:, p // 2 :].double().cpu()
    cos, sin = make_cos_sin(32, p, theta)[positions.cpu()].double().chunk(2, dim=-1)
    neox = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    assert not torch.allclose(written[1:], neox[1:], atol=1e-2)


def test_write_no_rows(device: torch.device) -> None:
    latent = torch.zeros(2, 4, 40, device=device)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    mla_write_latent(
        torch.zeros(0, 32, device=device),
        torch.zeros(0, 8, device=device),
        empty,
        make_cos_sin(8, 8).to(device),
        latent,
        empty,
    )
    assert not latent.any()


@pytest.mark.parametrize("h,p", [(4, 8), (3, 6), (20, 16)])
def test_rope_interleaved_in_place(
    h: int, p: int, dtype_tol: tuple[torch.dtype, float, float], device: torch.device
) -> None:
    """q_pe as the tail slice of [N, H, nope + P] queries: rotated, q_nope left alone."""
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(h * p)
    n, nope = 5, 12
    q = torch.randn(n, h, nope + p, generator=gen).to(device, dtype)
    q_pe = q[..., nope:]
    assert not q_pe.is_contiguous()
    q_before = q.clone()
    positions = torch.randint(0, 50, (n,), generator=gen).to(device)
    cos_sin = make_cos_sin(50, p).to(device)
    expected = rope_interleaved_ref(q_pe, positions, cos_sin)
    rope_interleaved(q_pe, positions, cos_sin)
    torch.testing.assert_close(q[..., nope:].double(), expected, atol=atol, rtol=rtol)
    assert torch.equal(q[..., :nope], q_before[..., :nope])


def test_rope_interleaved_matches_complex_form_and_keeps_relative_positions(
    device: torch.device,
) -> None:
    """q_pe . k_pe after rotation depends only on the position difference."""
    gen = torch.Generator().manual_seed(31)
    p = 16
    cos_sin = make_cos_sin(64, p).to(device)
    q = torch.randn(1, 2, p, generator=gen).to(device)
    k = torch.randn(1, p, generator=gen).to(device)
    dots = []
    for q_pos, k_pos in [(10, 3), (40, 33), (7, 0)]:
        qr = q.clone()
        rope_interleaved(qr, torch.tensor([q_pos], device=device), cos_sin)
        torch.testing.assert_close(
            qr.double().cpu(), rope_complex_ref(q, torch.tensor([q_pos]), 10000.0)
        )
        latent = torch.zeros(1, 1, p + 16, device=device)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        c = torch.zeros(1, 16, device=device)
        mla_write_latent(c, k, torch.tensor([k_pos], device=device), cos_sin, latent, zero)
        dots.append(qr[0] @ latent[0, 0, 16:])
    torch.testing.assert_close(dots[1], dots[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dots[2], dots[0], atol=1e-4, rtol=1e-4)


def test_rope_interleaved_position_zero_and_no_rows(device: torch.device) -> None:
    x = torch.randn(2, 3, 8, device=device)
    x0 = x.clone()
    rope_interleaved(
        x, torch.zeros(2, dtype=torch.int64, device=device), make_cos_sin(4, 8).to(device)
    )
    torch.testing.assert_close(x, x0)
    empty = torch.zeros(0, 3, 8, device=device)
    rope_interleaved(
        empty, torch.zeros(0, dtype=torch.int64, device=device), make_cos_sin(4, 8).to(device)
    )


def _write_args(**overrides: object) -> list[object]:
    args: dict[str, object] = {
        "c": torch.randn(2, 32),
        "k_pe": torch.randn(2, 8),
        "positions": torch.arange(2),
        "cos_sin": make_cos_sin(8, 8),
        "latent": torch.zeros(3, 4, 40),
        "slots": torch.arange(2),
    }
    args.update(overrides)
    return list(args.values())


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"cos_sin": make_cos_sin(8, 16)}, "cos_sin's width"),
        ({"k_pe": torch.randn(2, 7), "latent": torch.zeros(3, 4, 39)}, "even"),
        ({"cos_sin": make_cos_sin(8, 8).double()}, "cos_sin must have dtype"),
        ({"positions": torch.arange(2, dtype=torch.int32)}, "positions must have dtype"),
        ({"slots": torch.arange(3)}, "slots must have shape"),
        ({"latent": torch.zeros(3, 4, 41)}, "latent must have shape"),
        ({"latent": torch.zeros(3, 40, 4).transpose(1, 2)}, "latent must be contiguous"),
        ({"k_pe": torch.randn(3, 8)}, "k_pe must have shape"),
        ({"c": torch.randn(32, 2).t()}, "c must have contiguous rows"),
        ({"c": torch.randn(2, 32).bfloat16()}, "dtypes must match"),
    ],
)
def test_write_rejects_bad_arguments(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mla_write_latent(*_write_args(**overrides))


@pytest.mark.parametrize(
    "x,positions,cos_sin,match",
    [
        (torch.randn(2, 3, 8), torch.arange(2), make_cos_sin(8, 6), "cos_sin's width"),
        (torch.randn(2, 3, 7), torch.arange(2), make_cos_sin(8, 8), "even"),
        (torch.randn(2, 8, 3).transpose(1, 2), torch.arange(2), make_cos_sin(8, 8), "last dim"),
        (torch.randn(2, 8), torch.arange(2), make_cos_sin(8, 8), "x must be 3-D"),
        (torch.randn(2, 3, 8), torch.arange(3), make_cos_sin(8, 8), "positions must have shape"),
    ],
)
def test_rope_rejects_bad_arguments(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        rope_interleaved(x, positions, cos_sin)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64, 4096])
def test_gpu_deepseek_v3_shape(n: int) -> None:
    """kv_lora_rank 512, qk_rope_head_dim 64, 128 query heads, YaRN-like theta."""
    h, nope, r, p, block_size, num_blocks = 128, 128, 512, 64, 64, 256
    dev, dt = "cuda", torch.bfloat16
    kv_a = torch.randn(n, r + p, device=dev, dtype=dt)
    c, k_pe = kv_a[:, :r], kv_a[:, r:]
    q = torch.randn(n, h, nope + p, device=dev, dtype=dt)
    positions = torch.randint(0, 8192, (n,), device=dev)
    cos_sin = make_cos_sin(8192, p).to(dev)
    latent = torch.randn(num_blocks, block_size, r + p, device=dev, dtype=dt)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:n]
    expected = write_latent_ref(c, k_pe, positions, cos_sin, latent, slots)
    q_expected = rope_interleaved_ref(q[..., nope:], positions, cos_sin)
    mla_write_latent(c, k_pe, positions, cos_sin, latent, slots)
    rope_interleaved(q[..., nope:], positions, cos_sin)
    torch.testing.assert_close(latent.double(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q[..., nope:].double(), q_expected, atol=2e-2, rtol=2e-2)
