"""top_support against a full ranking (a stable descending sort in float64: by value, ties
to the lower id), on rows built to stress each bound: ties, masks, skew; the group maxima
select_drafts writes for it, and the kept mass it sums for a sampler, against plain torch in
float64."""

from __future__ import annotations

import pytest
import torch
from test_select_drafts import allowed_from_bitmask, random_bitmask

from mtpdraft.kernels import select_drafts, top_support, top_support_group


def _ranked(logits: torch.Tensor, support: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logits.double().sort(dim=-1, descending=True, stable=True)
    return values[:, :support], ids[:, :support]


def _check(logits: torch.Tensor, support: int, maxima=None) -> None:
    values, ids, kept_mass = top_support(logits, support, maxima=maxima)
    assert kept_mass is None
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "support"), [(5000, 16), (9000, 64)])
def test_group_maxima_from_select_drafts(device, dtype, vocab, support) -> None:
    """select_drafts' pass writes each group's largest allowed logit (the bitmask applied);
    from them top_support ranks as from its own."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(3, vocab, generator=gen) * 4).to(dtype)
    bitmask = random_bitmask(3, vocab, gen)
    bitmask[2] = -1  # every token allowed
    masked = logits.float().masked_fill(~allowed_from_bitmask(bitmask, 3, vocab), float("-inf"))
    group = top_support_group(vocab, support)
    groups = -(-vocab // group)
    maxima = torch.full((3, groups), 7.0, device=device)
    select_drafts(logits.to(device), bitmask.to(device), num_splits=2, maxima=(maxima, group))
    padded = torch.full((3, groups * group), float("-inf"))
    padded[:, :vocab] = masked
    assert torch.equal(maxima.cpu(), padded.view(3, groups, group).amax(-1))
    _check(masked.to(dtype).to(device), support, maxima=(maxima, group))


def test_kept_mass_is_what_min_p_keeps_of_the_vocabulary(device) -> None:
    """Summed in parts as the support is gathered, for the rows whose top-p needs it (no
    top-k cut, top_p < 1, sampled); 0 for the others."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 3000, generator=gen) * 3
    logits[1, ::3] = float("-inf")
    cases = [(0.7, 0, 0.9, 0.0), (1.2, 0, 0.8, 0.05), (1.0, 5, 0.9, 0.0), (0.0, 0, 0.9, 0.0),
             (1.0, 0, 1.0, 0.0)]  # fmt: skip
    t, k, p, m = (torch.tensor(c) for c in zip(*cases, strict=True))
    params = (t.float(), k.long(), p.float(), m.float())
    top = top_support(logits.to(device), 16, params=tuple(c.to(device) for c in params))
    x = logits.double()
    e = ((x - x.amax(-1, keepdim=True)) / t.double().clamp(min=1e-3)[:, None]).exp()
    want = torch.where(e >= m.double()[:, None], e, 0).sum(-1)
    want = torch.where((t > 0) & (k <= 0) & (p < 1), want, 0)
    torch.testing.assert_close(top.kept_mass.cpu().double().sum(-1), want, rtol=1e-5, atol=0)


def test_bad_arguments_are_refused(device) -> None:
    logits = torch.zeros(2, 10, device=device)
    with pytest.raises(ValueError, match="support"):
        top_support(logits, 11)
    with pytest.raises(ValueError, match="support"):
        top_support(logits, 0)
    with pytest.raises(ValueError, match="dtype"):
        top_support(logits.long(), 2)
    values, ids, _ = top_support(logits[:0], 3)
    assert values.shape == (0, 3) and ids.shape == (0, 3)
    group = top_support_group(10, 2)
    with pytest.raises(ValueError, match="groups of"):
        top_support(logits, 2, maxima=(torch.zeros(2, 10, device=device), group * 2))
    with pytest.raises(ValueError, match="maxima"):
        top_support(logits, 2, maxima=(torch.zeros(2, 4, device=device), group))  # 3 groups
    with pytest.raises(ValueError, match="top_k"):
        top_support(logits, 2, params=(torch.ones(2, device=device),) * 4)
