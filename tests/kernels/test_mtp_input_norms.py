"""mtp_input_norms against two torch RMSNorms and a concat."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.kernels import mtp_input_norms


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * (w.float() + 1.0 if unit_offset else w.float())


def mtp_input_norms_ref(
    embeds: torch.Tensor,
    hiddens: torch.Tensor,
    embed_weight: torch.Tensor,
    hidden_weight: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    embed_first: bool,
    unit_offset: bool,
    mask_first: bool = True,
) -> torch.Tensor:
    e = embeds.float().masked_fill(((positions == 0) & mask_first)[:, None], 0.0)
    e = _norm(e, embed_weight, eps, unit_offset)
    h = _norm(hiddens.float(), hidden_weight, eps, unit_offset)
    parts = [e, h] if embed_first else [h, e]
    return torch.cat(parts, dim=-1).to(embeds.dtype)


@pytest.mark.parametrize("n,h", [(1, 64), (7, 100), (4, 1000)])
@pytest.mark.parametrize("embed_first", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_matches_reference(
    n: int,
    h: int,
    embed_first: bool,
    unit_offset: bool,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(n * h)
    embeds = torch.randn(n, h, generator=gen).to(device, dtype)
    hiddens = (torch.randn(n, h, generator=gen) * 5).to(device, dtype)
    ew = (torch.rand(h, generator=gen) + 0.5).to(device, dtype)
    hw = (torch.rand(h, generator=gen) + 0.5).to(device, dtype)
    positions = torch.arange(n, dtype=torch.int64).to(device)  # row 0 is at position 0
    if n > 3:
        positions[3] = 0  # a second sequence starting in the batch
    args = (embeds, hiddens, ew, hw, positions, 1e-6)
    out = mtp_input_norms(*args, embed_first=embed_first, unit_offset=unit_offset)
    ref = mtp_input_norms_ref(*args, embed_first, unit_offset)
    assert out.dtype == dtype and out.shape == (n, 2 * h)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    e_half = out[:, :h] if embed_first else out[:, h:]
    assert torch.all(e_half[positions == 0] == 0)
    assert torch.all(e_half[positions != 0] != 0)


def test_position_0_keeps_its_embedding_unless_masked(device: torch.device) -> None:
    """Qwen3-Next's MTP layer does not zero the first row's embedding (mask_first=False)."""
    gen = torch.Generator().manual_seed(3)
    embeds, hiddens = (torch.randn(3, 32, generator=gen).to(device) for _ in range(2))
    w = torch.full((32,), 0.1, device=device)
    positions = torch.tensor([0, 1, 0], device=device)
    args = (embeds, hiddens, w, w, positions, 1e-6)
    out = mtp_input_norms(*args, embed_first=True, unit_offset=True, mask_first=False)
    ref = mtp_input_norms_ref(*args, True, True, mask_first=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[:, :32] != 0)


@pytest.mark.parametrize("embed_first", [False, True])
def test_reads_the_rows_embeddings_from_the_table_by_token(
    embed_first: bool, dtype_tol: tuple[torch.dtype, float, float], device: torch.device
) -> None:
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(11)
    table = torch.randn(50, 48, generator=gen).to(device, dtype)
    tokens = torch.tensor([7, 49, 0, 7, 23], device=device)
    hiddens = torch.randn(5, 48, generator=gen).to(device, dtype)
    w = (torch.rand(48, generator=gen) + 0.5).to(device, dtype)
    positions = torch.tensor([0, 1, 2, 3, 4], device=device)
    out = mtp_input_norms(
        table, hiddens, w, w, positions, 1e-6, embed_first=embed_first, tokens=tokens
    )
    ref = mtp_input_norms_ref(table[tokens], hiddens, w, w, positions, 1e-6, embed_first, False)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_rejects_bad_arguments() -> None:
    e, h, w = torch.randn(3, 8), torch.randn(3, 8), torch.ones(8)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="positions must have dtype"):
        mtp_input_norms(e, h, w, w, pos.int(), 1e-6, embed_first=True)
    with pytest.raises(ValueError, match="hiddens must have shape"):
        mtp_input_norms(e, torch.randn(3, 9), w, w, pos, 1e-6, embed_first=True)
    with pytest.raises(ValueError, match="dtypes must match"):
        mtp_input_norms(e, h.bfloat16(), w, w, pos, 1e-6, embed_first=True)
    with pytest.raises(ValueError, match="positions must have shape"):
        mtp_input_norms(e, h, w, w, torch.arange(4), 1e-6, embed_first=True)
    with pytest.raises(ValueError, match="hidden_weight must have shape"):
        mtp_input_norms(e, h, w, torch.ones(4), pos, 1e-6, embed_first=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("embed_first", [False, True])
def test_gpu_mimo_shape(n: int, embed_first: bool) -> None:
    h = 4096
    embeds = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    hiddens = torch.randn(n, h, device="cuda", dtype=torch.bfloat16) * 5
    ew = torch.rand(h, device="cuda", dtype=torch.bfloat16)
    hw = torch.rand(h, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 3, (n,), device="cuda")
    args = (embeds, hiddens, ew, hw, positions, 1e-6)
    out = mtp_input_norms(*args, embed_first=embed_first)
    ref = mtp_input_norms_ref(*args, embed_first, False)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
