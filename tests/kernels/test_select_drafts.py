"""select_drafts against a masked torch argmax and softmax."""

from __future__ import annotations

import math

import pytest
import torch

from mtpdraft.kernels import select_drafts


def allowed_from_bitmask(bitmask: torch.Tensor | None, n: int, vocab: int) -> torch.Tensor:
    """[N, V] bool: bit t % 32 of word t // 32 allows token t; tokens past 32 * W are not."""
    if bitmask is None:
        return torch.ones(n, vocab, dtype=torch.bool, device="cpu")
    tokens = torch.arange(vocab)
    words = tokens // 32
    in_mask = words < bitmask.shape[1]
    bits = (bitmask.cpu().long()[:, words.clamp(max=bitmask.shape[1] - 1)] >> (tokens % 32)) & 1
    return (bits == 1) & in_mask


def select_drafts_ref(
    logits: torch.Tensor, bitmask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    n, vocab = logits.shape
    allowed = allowed_from_bitmask(bitmask, n, vocab).to(logits.device)
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    tokens = masked.argmax(dim=-1)
    probs = masked.softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
    none = ~allowed.any(dim=-1)
    return tokens.masked_fill(none, -1), probs.masked_fill(none, 0.0)


def pack_bitmask(allowed: torch.Tensor, words: int | None = None) -> torch.Tensor:
    """Pack [N, V] bool into xgrammar's [N, ceil(V / 32)] int32 layout (or ``words`` words)."""
    n, vocab = allowed.shape
    words = words or math.ceil(vocab / 32)
    padded = torch.zeros(n, words * 32, dtype=torch.bool)
    keep = min(vocab, words * 32)
    padded[:, :keep] = allowed[:, :keep].cpu()
    bits = padded.view(n, words, 32).long() << torch.arange(32)
    packed = bits.sum(dim=-1)  # < 2**32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def random_bitmask(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, (n, math.ceil(vocab / 32)), generator=gen).int()


@pytest.mark.parametrize("n,vocab", [(1, 100), (7, 1000), (3, 5003), (2, 9000)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_matches_reference(
    n: int,
    vocab: int,
    masked: bool,
    num_splits: int | None,
    dtype_tol: tuple[torch.dtype, float, float],
    device: torch.device,
) -> None:
    dtype, _, _ = dtype_tol
    gen = torch.Generator().manual_seed(n * vocab)
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(device, dtype)
    bitmask = random_bitmask(n, vocab, gen).to(device) if masked else None
    tokens, probs = select_drafts(logits, bitmask, num_splits=num_splits)
    ref_tokens, ref_probs = select_drafts_ref(logits, bitmask)
    assert tokens.dtype == torch.int64 and probs.dtype == torch.float32
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=1e-5)


def test_bitmask_round_trip() -> None:
    """The test's packer and unpacker agree, including bit 31 (negative words)."""
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 100, generator=gen) < 0.5
    allowed[:, 31] = True
    assert torch.equal(allowed_from_bitmask(pack_bitmask(allowed), 3, 100), allowed)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_masked_tokens_never_win(num_splits: int | None, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    n, vocab = 5, 6000
    logits = torch.randn(n, vocab, generator=gen)
    allowed = torch.rand(n, vocab, generator=gen) < 0.1
    logits[~allowed] += 100.0  # every disallowed token beats every allowed one
    bitmask = pack_bitmask(allowed).to(device)
    tokens, probs = select_drafts(logits.to(device), bitmask, num_splits=num_splits)
    assert allowed[torch.arange(n), tokens.cpu()].all()
    ref_tokens, ref_probs = select_drafts_ref(logits, pack_bitmask(allowed))
    assert torch.equal(tokens.cpu(), ref_tokens)
    torch.testing.assert_close(probs.cpu(), ref_probs)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_ties_go_to_lowest_index(
    masked: bool, num_splits: int | None, device: torch.device
) -> None:
    vocab = 9000  # several tiles: ties within a tile and across tiles
    logits = torch.zeros(4, vocab)
    logits[0, [7, 3, 4500]] = 5.0  # within the first tile
    logits[1, [8000, 4100]] = 5.0  # across tiles: 4100 is in an earlier tile
    logits[2, [20, 8999]] = 5.0
    logits[3] = 1.0  # all equal
    allowed = torch.ones(4, vocab, dtype=torch.bool)
    if masked:
        allowed[2, 20] = False  # the lowest tied index is disallowed: the next one wins
        allowed[3, :5] = False
    bitmask = pack_bitmask(allowed).to(device) if masked else None
    tokens, probs = select_drafts(logits.to(device), bitmask, num_splits=num_splits)
    expected = [3, 4100, 8999 if masked else 20, 5 if masked else 0]
    assert tokens.cpu().tolist() == expected
    ref_tokens, ref_probs = select_drafts_ref(logits, bitmask)
    assert torch.equal(tokens.cpu(), ref_tokens)
    torch.testing.assert_close(probs.cpu(), ref_probs)


@pytest.mark.parametrize("only", [0, 31, 32, 4321, 4999])
@pytest.mark.parametrize("num_splits", [None, 2])
def test_all_but_one_masked(only: int, num_splits: int | None, device: torch.device) -> None:
    vocab = 5000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(only)) * 10
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[:, only] = True
    allowed[1] = True  # the second row allows everything
    bitmask = pack_bitmask(allowed).to(device)
    tokens, probs = select_drafts(logits.to(device), bitmask, num_splits=num_splits)
    assert tokens[0].item() == only
    assert probs[0].item() == 1.0
    assert tokens[1].item() == logits[1].argmax().item()


def test_short_bitmask_disallows_the_tail(device: torch.device) -> None:
    """W < ceil(V / 32): tokens at or past 32 * W are disallowed, however large."""
    vocab, words = 1000, 10  # tokens >= 320 disallowed
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2))
    logits[:, 500:] += 50.0
    allowed = torch.ones(3, vocab, dtype=torch.bool)
    bitmask = pack_bitmask(allowed, words=words)
    assert bitmask.shape == (3, words)
    tokens, probs = select_drafts(logits.to(device), bitmask.to(device))
    assert (tokens < 32 * words).all()
    ref_tokens, ref_probs = select_drafts_ref(logits, bitmask)
    assert torch.equal(tokens.cpu(), ref_tokens)
    torch.testing.assert_close(probs.cpu(), ref_probs)


def test_long_bitmask_ignores_extra_words(device: torch.device) -> None:
    vocab = 100
    logits = torch.randn(1, vocab)
    bitmask = torch.full((1, 10), -1, dtype=torch.int32)  # 320 bits for 100 tokens
    tokens, probs = select_drafts(logits.to(device), bitmask.to(device))
    assert tokens.item() == logits.argmax().item()
    torch.testing.assert_close(probs.cpu(), logits.softmax(-1).max(-1).values)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_nothing_allowed(num_splits: int, device: torch.device) -> None:
    logits = torch.randn(2, 9000, device=device)
    bitmask = torch.zeros(2, 282, dtype=torch.int32, device=device)
    bitmask[1, 3] = 1 << 5  # row 1 allows token 101 only
    tokens, probs = select_drafts(logits, bitmask, num_splits=num_splits)
    assert tokens.tolist() == [-1, 101]
    assert probs.tolist() == [0.0, 1.0]


def test_probability_of_a_confident_row(device: torch.device) -> None:
    logits = torch.full((1, 2000), -5.0)
    logits[0, 1234] = 5.0
    tokens, probs = select_drafts(logits.to(device), None)
    expected = 1.0 / (1.0 + 1999 * math.exp(-10.0))
    assert tokens.item() == 1234
    assert probs.item() == pytest.approx(expected, rel=1e-6)


def test_rejects_bad_arguments() -> None:
    logits = torch.randn(2, 64)
    with pytest.raises(ValueError, match="bitmask must have dtype"):
        select_drafts(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="bitmask must have 2 rows"):
        select_drafts(logits, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="logits must be contiguous"):
        select_drafts(torch.randn(64, 2).t(), None)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        select_drafts(torch.randn(64), None)
    with pytest.raises(ValueError, match="num_splits"):
        select_drafts(logits, None, num_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_mimo_vocab(n: int, masked: bool, num_splits: int | None) -> None:
    vocab = 151680
    gen = torch.Generator().manual_seed(n)
    logits = (torch.randn(n, vocab, generator=gen) * 4).to("cuda", torch.bfloat16)
    bitmask = random_bitmask(n, vocab, gen).cuda() if masked else None
    tokens, probs = select_drafts(logits, bitmask, num_splits=num_splits)
    ref_tokens, ref_probs = select_drafts_ref(logits, bitmask)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_grammar_mask_with_short_bitmask() -> None:
    vocab, words = 151680, 4700  # 150400 tokens covered; the rest disallowed
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, vocab, generator=gen)
    logits[:, 150400:] += 100.0
    allowed = torch.rand(8, vocab, generator=gen) < 0.01
    bitmask = pack_bitmask(allowed, words=words).cuda()
    tokens, probs = select_drafts(logits.cuda(), bitmask)
    ref_tokens, ref_probs = select_drafts_ref(logits.cuda(), bitmask)
    assert (tokens < 150400).all()
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=1e-5)
