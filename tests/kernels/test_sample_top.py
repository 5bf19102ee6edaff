"""sample_top (after top_support, which ranks its support and sums the kept mass) against
vLLM's sampler in float64 and SplitMix64 on Python integers (tests/sampling_reference.py),
and against ties ranked by hand."""

from __future__ import annotations

import pytest
import torch
from sampling_reference import Q_ATOL, drawn, uniform, vllm_processed

from mtpdraft.kernels import sample_top, top_support

CASES = [  # temperature, top_k, top_p, min_p (temperature 0: greedy)
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),  # top-p over the whole vocabulary's mass
    (0.8, 0, 0.6, 0.02),  # ... the mass min-p keeps of it
    (1.3, 5, 1.0, 0.0),
    (0.5, 12, 0.8, 0.05),
    (0.0, 0, 1.0, 0.0),
    (2.0, 3, 0.5, 0.0),
    (1.0, 0, 1.0, 0.3),
]
VOCAB = 5000  # several parts of the kept mass's sum, each of several tiles


def _columns(cases, device):
    temperature, top_k, top_p, min_p = zip(*cases, strict=True)
    return (
        torch.tensor(temperature, dtype=torch.float32, device=device),
        torch.tensor(top_k, dtype=torch.int64, device=device),
        torch.tensor(top_p, dtype=torch.float32, device=device),
        torch.tensor(min_p, dtype=torch.float32, device=device),
    )


def _shuffled(logits, width, params, gen):
    """top_support's support and kept mass, the support's columns in a random order (the
    sampler takes any)."""
    values, ids, mass = top_support(logits, width, params=params)
    order = torch.randperm(width, generator=gen).to(logits.device)
    return values[:, order], ids[:, order], mass


def _keys(n: int, device, seed: int = 9):
    return tuple(
        torch.tensor(c, dtype=torch.int64, device=device)
        for c in ([seed] * n, list(range(100, 100 + n)), [7 * i + 3 for i in range(n)], [2] * n)
    )


@pytest.mark.parametrize(("support", "width"), [(16, 16), (8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_and_draft_are_the_references(device, support: int, width: int, dtype) -> None:
    n = len(CASES)
    gen = torch.Generator().manual_seed(1)
    # The reference ranks ties otherwise than the kernel (by the lower id): no ties among
    # the top 20 (bf16 rounds many logits together), distinct values exact in bf16 above
    # all the rest.
    logits = (3 * torch.randn(n, VOCAB, generator=gen)).clamp(max=5.75).to(dtype)
    top20 = logits.float().topk(20).indices
    distinct = (6 + 0.25 * torch.randperm(20, generator=gen)).to(dtype)
    logits.scatter_(1, top20, distinct.expand(n, 20))
    logits[3, ::7] = float("-inf")  # a grammar's mask
    greedy = (torch.arange(n, dtype=torch.int64) * 11, torch.linspace(0.1, 0.9, n))
    keys, params = _keys(n, device), _columns(CASES, device)
    tokens, probs, q_ids, q_probs = sample_top(
        _shuffled(logits.to(device), width, params, gen), params, keys,
        tuple(g.to(device) for g in greedy), support,
    )  # fmt: skip
    tokens, probs, q_ids, q_probs = (t.cpu() for t in (tokens, probs, q_ids, q_probs))
    assert q_ids.shape == q_probs.shape == (n, support)
    for row, case in enumerate(CASES):
        if case[0] == 0:
            assert tokens[row] == greedy[0][row] and probs[row] == greedy[1][row]
            assert q_ids[row, 0] == greedy[0][row] and q_probs[row, 0] == 1
            assert not q_probs[row, 1:].any() and not q_ids[row, 1:].any()
            continue
        want = vllm_processed(logits[row].float(), *case, support)
        got = torch.zeros(VOCAB, dtype=torch.float64)
        got.index_add_(0, q_ids[row], q_probs[row].double())
        torch.testing.assert_close(got, want, atol=Q_ATOL, rtol=0)
        assert (q_probs[row][:-1] >= q_probs[row][1:]).all()  # by rank
        assert len(set(q_ids[row].tolist())) == support
        u = uniform(*(int(k[row]) for k in keys))
        expected = drawn(want, u, margin=1e-4)
        assert expected is None or int(tokens[row]) == expected
        assert float(probs[row]) == pytest.approx(float(want[tokens[row]]), abs=Q_ATOL)


def test_ties_rank_by_the_lower_id(device) -> None:
    """Equal logits rank by id: a row of ties keeps the lowest ids, with equal probability;
    a top-k of 2 among four tied tokens keeps the two lower ids."""
    logits = torch.zeros(2, 64)
    logits[1, [40, 9, 30, 21]] = 5.0
    params = _columns([(1.0, 0, 1.0, 0.0), (1.0, 2, 1.0, 0.0)], device)
    _, _, q_ids, q_probs = sample_top(
        _shuffled(logits.to(device), 64, params, torch.Generator().manual_seed(3)), params,
        _keys(2, device),
        (torch.zeros(2, dtype=torch.int64, device=device), torch.ones(2, device=device)), 4,
    )  # fmt: skip
    assert q_ids.cpu().tolist() == [[0, 1, 2, 3], [9, 21, 30, 40]]
    assert q_probs.cpu().tolist() == [[0.25] * 4, [0.5, 0.5, 0.0, 0.0]]


def test_a_draw_depends_on_its_key_alone(device) -> None:
    """A row's draft is the same alone and with other rows beside it; another seed moves it."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=gen).to(device)
    cases = [(1.5, 0, 1.0, 0.0)] * 6

    def drafts(rows, seed):
        params = _columns([cases[r] for r in rows], device)
        return sample_top(
            top_support(logits[rows], 32, params=params),
            params,
            tuple(k[rows] for k in _keys(6, device, seed)),
            (torch.zeros(len(rows), dtype=torch.int64, device=device),
             torch.ones(len(rows), device=device)),
            32,
        )[0].cpu().tolist()  # fmt: skip

    together = drafts(list(range(6)), 9)
    assert [drafts([r], 9)[0] for r in range(6)] == together
    assert drafts(list(range(6)), 10) != together


def test_key_offsets_move_the_position_and_the_index(device) -> None:
    """A captured step adds constants to the key's position and index: the same draws as
    those words given whole."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 400, generator=gen).to(device)
    params = _columns([(1.0, 0, 1.0, 0.0)] * 8, device)
    top = top_support(logits, 32, params=params)
    greedy = (torch.zeros(8, dtype=torch.int64, device=device), torch.ones(8, device=device))
    seed, state, position, index = _keys(8, device)
    whole = sample_top(top, params, (seed, state, position + 2, index + 3), greedy, 32)
    offset = sample_top(top, params, (seed, state, position, index), greedy, 32, None, (2, 3))
    plain = sample_top(top, params, (seed, state, position, index), greedy, 32)
    assert torch.equal(whole[0], offset[0]) and not torch.equal(whole[0], plain[0])
    for row, token in enumerate(offset[0].tolist()):
        q = torch.zeros(400, dtype=torch.float64)
        q.index_add_(0, offset[2][row].cpu(), offset[3][row].cpu().double())
        u = uniform(9, 100 + row, 7 * row + 3 + 2, 2 + 3)
        expected = drawn(q, u, margin=1e-6)
        assert expected is None or token == expected


def test_bad_arguments_are_refused(device) -> None:
    logits = torch.randn(2, 50, device=device)
    params = _columns([(1.0, 0, 1.0, 0.0)] * 2, device)
    top = top_support(logits, 4, params=params)
    args = (
        params, _keys(2, device),
        (torch.zeros(2, dtype=torch.int64, device=device), torch.ones(2, device=device)),
    )  # fmt: skip
    with pytest.raises(ValueError, match="top values"):
        sample_top(top, *args, 8)  # support beyond the top
    with pytest.raises(ValueError, match="top_k"):
        bad = (args[0][0], args[0][1].int(), *args[0][2:])
        sample_top(top, bad, *args[1:], 4)
    with pytest.raises(ValueError, match="kept mass"):
        sample_top((top.values, top.ids, None), *args, 4)  # no kept mass
