"""rope_write_kv against rotate_half RoPE and an indexed cache write in torch."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.kernels import rope_write_kv


def make_cos_sin(max_pos: int, rot: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    rot = cos_sin.shape[1]
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [N, ROT/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    x1, x2, rest = xf[..., : rot // 2], xf[..., rot // 2 : rot], xf[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)


def rope_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated q and k, and the caches after the write."""
    q_out, k_out = rope_ref(q, positions, cos_sin), rope_ref(k, positions, cos_sin)
    kc, vc = k_cache.clone(), v_cache.clone()
    keep = slot_mapping >= 0
    kc.view(-1, *kc.shape[2:])[slot_mapping[keep]] = k_out[keep]
    vc.view(-1, *vc.shape[2:])[slot_mapping[keep]] = v[keep]
    return q_out, k_out, kc, vc


@pytest.mark.parametrize(
    "n,hq,hkv,d,rot,block_size",
    [
        (1, 4, 2, 16, 16, 4),  # full rotary
        (7, 6, 2, 24, 8, 3),  # partial rotary, odd head dim and block size
        (5, 4, 4, 32, 24, 8),  # rotary dims not a power of two
    ],
)
def test_matches_reference(
    n: int,
    hq: int,
    hkv: int,
    d: int,
    rot: int,
    block_size: int,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(n * d + rot)
    max_pos, num_blocks = 64, 6
    q = torch.randn(n, hq, d, generator=gen).to(device, dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(device, dtype)
    positions = torch.randint(0, max_pos, (n,), generator=gen).to(device)
    cos_sin = make_cos_sin(max_pos, rot).to(device)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    if n > 2:
        slots[1] = -1  # a padding row: rotated, not written
    slot_mapping = slots.to(device)
    q_ref, k_ref, kc_ref, vc_ref = rope_write_kv_ref(
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping
    )
    v_before = v.clone()
    rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(k.float(), k_ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(k_cache.float(), kc_ref.float(), atol=atol, rtol=rtol)
    assert torch.equal(v_cache, vc_ref)
    assert torch.equal(v, v_before)


def test_strided_views_of_one_projection(device: torch.device) -> None:
    """q, k, v split out of one [N, q + 2 kv] tensor are read and rotated in place."""
    n, hq, hkv, d, rot, block_size = 5, 4, 2, 16, 16, 4
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).to(device)
    untouched = qkv.clone()
    q, k, v = (
        t.view(n, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    )  # fmt: skip
    assert not q.is_contiguous()
    positions = torch.randint(0, 32, (n,), generator=gen).to(device)
    cos_sin = make_cos_sin(32, rot).to(device)
    k_cache = torch.zeros(4, block_size, hkv, d, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, -1, 0, 9, 15], device=device)
    q_ref, k_ref, kc_ref, vc_ref = rope_write_kv_ref(
        q.contiguous(), k.contiguous(), v.contiguous(), positions, cos_sin, k_cache, v_cache,
        slots,
    )  # fmt: skip
    rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, kc_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(v_cache, vc_ref)
    assert torch.equal(qkv[:, (hq + hkv) * d :], untouched[:, (hq + hkv) * d :])  # v as it was


def test_position_zero_is_identity(device: torch.device) -> None:
    q = torch.randn(1, 2, 16, device=device)
    k = torch.randn(1, 1, 16, device=device)
    q0, k0 = q.clone(), k.clone()
    k_cache = torch.zeros(1, 4, 1, 16, device=device)
    v_cache = torch.zeros_like(k_cache)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    rope_write_kv(q, k, k.clone(), zero, make_cos_sin(8, 16).to(device), k_cache, v_cache, zero)
    torch.testing.assert_close(q, q0)
    torch.testing.assert_close(k_cache[0, 0], k0[0])


def _args(**overrides: torch.Tensor) -> list[torch.Tensor]:
    args = {
        "q": torch.randn(2, 4, 16),
        "k": torch.randn(2, 2, 16),
        "v": torch.randn(2, 2, 16),
        "positions": torch.arange(2),
        "cos_sin": make_cos_sin(8, 16),
        "k_cache": torch.zeros(3, 4, 2, 16),
        "v_cache": torch.zeros(3, 4, 2, 16),
        "slot_mapping": torch.arange(2),
    }
    args.update(overrides)
    return list(args.values())


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"cos_sin": make_cos_sin(8, 18)}, "rotary dims"),
        ({"cos_sin": make_cos_sin(8, 16)[:, :7].contiguous()}, "rotary dims"),
        ({"cos_sin": make_cos_sin(8, 16).double()}, "cos_sin must have dtype"),
        ({"positions": torch.arange(2, dtype=torch.int32)}, "positions must have dtype"),
        ({"k_cache": torch.zeros(3, 4, 1, 16)}, "k_cache must have shape"),
        ({"v_cache": torch.zeros(2, 4, 2, 16)}, "v_cache must have shape"),
        ({"v": torch.randn(2, 3, 16)}, "v must have shape"),
        ({"k": torch.randn(2, 16, 2).transpose(1, 2)}, "k must have contiguous rows"),
        ({"q": torch.randn(80).as_strided((2, 4, 16), (16, 16, 1))}, "rows must not overlap"),
        ({"q": torch.randn(2, 4, 16).bfloat16()}, "dtypes must match"),
        ({"slot_mapping": torch.arange(3)}, "slot_mapping must have shape"),
    ],
)
def test_rejects_bad_arguments(overrides: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rope_write_kv(*_args(**overrides))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("rot", [128, 64])
def test_gpu_mimo_shape(n: int, rot: int) -> None:
    hq, hkv, d, block_size, num_blocks = 32, 8, 128, 16, 1024
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(n, hq, d, device=dev, dtype=dt)
    k = torch.randn(n, hkv, d, device=dev, dtype=dt)
    v = torch.randn(n, hkv, d, device=dev, dtype=dt)
    positions = torch.randint(0, 8192, (n,), device=dev)
    cos_sin = make_cos_sin(8192, rot, theta=640000.0).to(dev)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    slot_mapping = torch.randperm(num_blocks * block_size, device=dev)[:n]
    q_ref, k_ref, kc_ref, vc_ref = rope_write_kv_ref(
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping
    )
    rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k.float(), k_ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_cache.float(), kc_ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(v_cache, vc_ref)
