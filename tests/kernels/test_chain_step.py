"""select_step / record_step against indexing in torch, over a few steps of a chain."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.kernels import record_step, select_step


def test_a_chain_of_steps_selects_and_records_each_row(device: torch.device) -> None:
    steps, n, h, words = 3, 5, 700, 9  # n * h spans several programs
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(-5, 100, (steps, 3, n), generator=gen).to(device)
    masks = torch.randint(-(2**31), 2**31 - 1, (steps, n, words), generator=gen).int().to(device)
    step = torch.zeros(1, dtype=torch.int64, device=device)
    cur = torch.full((1,), 7, dtype=torch.int64, device=device)
    now = torch.empty(3, n, dtype=torch.int64, device=device)
    mask_now = torch.empty(n, words, dtype=torch.int32, device=device)
    out_h = torch.zeros(steps, n, h, device=device, dtype=torch.bfloat16)
    out_t = torch.zeros(steps, n, dtype=torch.int64, device=device)
    out_p = torch.zeros(steps, n, device=device)
    feed_h = torch.zeros(n, h, device=device, dtype=torch.bfloat16)
    feed_t = torch.zeros(n, dtype=torch.int64, device=device)
    outputs = []
    for j in range(steps):
        select_step(step, cur, rows, now, masks, mask_now)
        assert int(cur) == j
        assert torch.equal(now, rows[j]) and torch.equal(mask_now, masks[j])
        hidden = torch.randn(n, h, generator=gen).to(device, torch.bfloat16)
        tokens = torch.randint(0, 50, (n,), generator=gen).to(device)
        probs = torch.rand(n, generator=gen).to(device)
        record_step(cur, step, hidden, tokens, probs, out_h, out_t, out_p, feed_h, feed_t)
        assert int(step) == j + 1
        assert torch.equal(feed_h, hidden) and torch.equal(feed_t, tokens)
        outputs.append((hidden, tokens, probs))
    for j, (hidden, tokens, probs) in enumerate(outputs):
        assert torch.equal(out_h[j], hidden)
        assert torch.equal(out_t[j], tokens)
        assert torch.equal(out_p[j], probs)


def test_select_step_without_a_second_table(device: torch.device) -> None:
    rows = torch.arange(24, dtype=torch.int64, device=device).view(4, 2, 3)
    step = torch.tensor([2], device=device)
    cur = torch.zeros(1, dtype=torch.int64, device=device)
    now = torch.empty(2, 3, dtype=torch.int64, device=device)
    select_step(step, cur, rows, now)
    assert torch.equal(now, rows[2]) and int(cur) == 2 and int(step) == 2


@pytest.mark.parametrize(
    "now,match",
    [
        (torch.empty(3, 2, dtype=torch.int64), "a_now must have shape"),
        (torch.empty(2, 3, dtype=torch.int32), "a_now must have dtype"),
    ],
)
def test_select_step_rejects_bad_buffers(now: torch.Tensor, match: str) -> None:
    rows = torch.zeros(4, 2, 3, dtype=torch.int64)
    index = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        select_step(index, index.clone(), rows, now)


def test_record_step_rejects_a_mismatched_output() -> None:
    z = torch.zeros
    index = z(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="out_t must have shape"):
        record_step(
            index, index.clone(), z(2, 4), z(2, dtype=torch.int64), z(2), z(3, 2, 4),
            z(3, 5, dtype=torch.int64), z(3, 2), z(2, 4), z(2, dtype=torch.int64),
        )  # fmt: skip
