"""top_support against a full ranking (a stable descending sort in float64: by value, ties
to the lower id), on rows built to stress each bound: ties, masks, skew."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.kernels import top_support


def _ranked(logits: torch.Tensor, support: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logits.double().sort(dim=-1, descending=True, stable=True)
    return values[:, :support], ids[:, :support]


def _check(logits: torch.Tensor, support: int) -> None:
    values, ids = top_support(logits, support)
    want_values, want_ids = _ranked(logits.cpu(), support)
    assert torch.equal(ids.cpu(), want_ids)
    assert torch.equal(values.cpu().double(), want_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "support"), [(1000, 16), (5000, 64), (300, 300), (70, 1)])
def test_random_rows(device, dtype, vocab, support) -> None:
    gen = torch.Generator().manual_seed(vocab + support)
    logits = (torch.randn(3, vocab, generator=gen) * 4).to(dtype)
    _check(logits.to(device), support)


def test_ties_rank_by_the_lower_id(device) -> None:
    """Few distinct values: the threshold is tied by hundreds of tokens in every tile."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 4, (2, 3000), generator=gen).float()
    logits[1] = 0.0  # every token tied
    _check(logits.to(device), 32)


def test_rows_with_fewer_allowed_tokens_than_the_support(device) -> None:
    """Masked rows: the allowed first, then the lowest disallowed ids, as a sort has them."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 2000, generator=gen)
    logits[0, torch.randperm(2000, generator=gen)[:1990]] = float("-inf")  # 10 allowed
    logits[1] = float("-inf")
    logits[1, 1999] = 0.5  # one allowed, the last id
    logits[2, 40:] = float("-inf")
    _check(logits.to(device), 64)


def test_skewed_rows_rank_several_thousand_candidates(device) -> None:
    """Logits falling with the id: the largest fill whole groups, so thousands of tokens lie
    above the threshold (the S-th group maximum) and are ranked in many rounds."""
    logits = -torch.arange(4096, dtype=torch.float32).repeat(2, 1)
    logits[1] = logits[1].flip(0)
    _check(logits.to(device), 64)


def test_bad_arguments_are_refused(device) -> None:
    logits = torch.zeros(2, 10, device=device)
    with pytest.raises(ValueError, match="support"):
        top_support(logits, 11)
    with pytest.raises(ValueError, match="support"):
        top_support(logits, 0)
    with pytest.raises(ValueError, match="dtype"):
        top_support(logits.long(), 2)
    values, ids = top_support(logits[:0], 3)
    assert values.shape == (0, 3) and ids.shape == (0, 3)
