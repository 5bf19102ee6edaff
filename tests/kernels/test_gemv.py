"""gemv and the fused LM head + draft selection against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtpdraft.kernels import gemv, lm_head_drafts, select_drafts

SHAPES = [(1, 64, 40), (3, 300, 130), (16, 520, 96), (33, 64, 70)]  # (M, N, K), odd sizes


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(
    m: int,
    n: int,
    k: int,
    with_bias: bool,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if with_bias else None
    y = gemv(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=atol * 2, rtol=rtol)


def _fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as a block-scaled FP8 checkpoint stores it: e4m3 values and fp32 scales."""
    (n, k), (bn, bk) = w.shape, block
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize(
    "m,n,k,block",
    [(1, 40, 72, (16, 16)), (5, 300, 256, (128, 128)), (3, 50, 96, (16, 24))],
    ids=["one-scale-per-tile", "deepseek-blocks", "a-scale-per-column"],
)
def test_gemv_reads_a_block_scaled_fp8_weight(
    m: int, n: int, k: int, block: tuple[int, int],
    dtype_tol: tuple[torch.dtype, float, float], device: torch.device,
) -> None:  # fmt: skip
    dtype, atol, rtol = dtype_tol
    gen = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w, scale = _fp8(torch.randn(n, k, generator=gen) / k**0.5, block)
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    dequantized = (w.float() * full).to(dtype)  # as the kernel rounds each tile
    y = gemv(x, w.to(device), weight_scale=scale.to(device), scale_block=block)
    ref = F.linear(x.float(), dequantized.float().to(device))
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=atol * 2, rtol=rtol)


def test_gemv_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="share K"):
        gemv(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="at most 64 rows"):
        gemv(torch.randn(65, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="bias must have shape"):
        gemv(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5))
    fp8 = torch.randn(4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        gemv(torch.randn(2, 8), fp8, weight_scale=torch.ones(2, 2), scale_block=(4, 8))
    with pytest.raises(ValueError, match="weight must have dtype"):
        gemv(torch.randn(2, 8), torch.randn(4, 8), weight_scale=torch.ones(1, 1))


def _packed(allowed: torch.Tensor) -> torch.Tensor:
    """[M, V] bool -> [M, ceil(V / 32)] int32 in xgrammar's layout."""
    m, v = allowed.shape
    words = -(-v // 32)
    bits = torch.zeros(m, words * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    return (bits.view(m, words, 32) << torch.arange(32)).sum(-1).to(torch.int32)


@pytest.mark.parametrize("m,vocab,k", [(1, 200, 48), (5, 333, 64), (20, 130, 32)])
@pytest.mark.parametrize("masked", [False, True])
def test_lm_head_drafts_equals_select_drafts_of_the_logits(
    m: int, vocab: int, k: int, masked: bool, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(m + vocab)
    h = torch.randn(m, k, generator=gen).to(device)
    w = torch.randn(vocab, k, generator=gen).to(device)
    bitmask = None
    if masked:
        allowed = torch.rand(m, vocab, generator=gen) < 0.3
        allowed[:, 7] = True  # at least one token per row
        bitmask = _packed(allowed).to(device)
    logits = torch.full((m, vocab), 7.0, device=device)
    tokens, probs = lm_head_drafts(h, w, bitmask, logits)
    want_t, want_p = select_drafts(F.linear(h, w), bitmask)
    assert torch.equal(tokens, want_t)
    torch.testing.assert_close(probs, want_p, atol=1e-5, rtol=1e-4)
    want = F.linear(h, w)  # the logits it writes: -inf where not allowed
    if masked:
        want = want.masked_fill(~allowed.to(device), float("-inf"))
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_lm_head_drafts_ties_go_to_the_lowest_token(device: torch.device) -> None:
    h = torch.ones(2, 16, device=device)
    w = torch.zeros(300, 16, device=device)
    w[[90, 250, 270]] = 1.0  # equal logits in different tiles
    tokens, probs = lm_head_drafts(h, w, None)
    assert tokens.tolist() == [90, 90]
    expected = 1.0 / (3 + 297 * torch.exp(torch.tensor(-16.0)))
    torch.testing.assert_close(probs, expected.expand(2).to(device), atol=1e-6, rtol=1e-5)


def test_lm_head_drafts_without_allowed_tokens_gives_minus_one(device: torch.device) -> None:
    bitmask = torch.zeros(1, 4, dtype=torch.int32, device=device)
    tokens, probs = lm_head_drafts(
        torch.randn(1, 8, device=device), torch.randn(100, 8, device=device), bitmask
    )
    assert tokens.tolist() == [-1] and probs.tolist() == [0.0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 8, 16, 33, 64])
def test_gpu_mimo_shapes(m: int, dtype: torch.dtype) -> None:
    """Every tile configuration the MiMo-7B shapes use, fp32 included (its tiles must fit)."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=gen).to(dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for n, k in [(6144, 4096), (4096, 11008), (22016, 4096)]:
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
        xk = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        torch.testing.assert_close(gemv(xk, w).float(), F.linear(xk, w).float(), atol=tol, rtol=tol)
    head = (torch.randn(151680, 4096, device="cuda", generator=gen) / 64).to(dtype)
    tokens, probs = lm_head_drafts(x, head, None)
    logits = F.linear(x, head).float()
    top2 = logits.topk(2, dim=-1).values
    tie = (top2[:, 0] - top2[:, 1]) / logits.abs().amax(-1) < 2e-2
    want_t, want_p = select_drafts(F.linear(x, head), None)
    assert ((tokens == want_t) | tie).all()
    torch.testing.assert_close(probs, want_p, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_fp8_deepseek_o_proj(m: int) -> None:
    """DeepSeek-V3's o_proj [7168, 16384], FP8 with 128 x 128 blocks."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 16384, generator=gen).to("cuda", torch.bfloat16)
    w, scale = _fp8(torch.randn(7168, 16384, generator=gen) / 128, (128, 128))
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    ref = F.linear(x.float(), (w.float() * full).bfloat16().float().cuda())
    y = gemv(x, w.cuda(), weight_scale=scale.cuda(), scale_block=(128, 128))
    torch.testing.assert_close(y.float(), ref, atol=5e-2, rtol=2e-2)
