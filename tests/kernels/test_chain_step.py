"""select_step / record_step / expand_block_tables against indexing in plain torch, over a
few steps of a chain."""

from __future__ import annotations

import pytest
import torch

from mtpdraft.kernels import expand_block_tables, record_step, select_step, stop_nonfinite_rows


def expected_rows(step: int, first, limits, tables, block_size: int) -> torch.Tensor:
    """[3, N]: positions, KV slots, context lengths of `step`, written out row by row."""
    rows = []
    for i in range(len(first)):
        first_i, limit = int(first[i]), int(limits[i])
        if limit == 0:  # padding
            rows.append((0, -1, 1))
            continue
        pos = first_i + min(step, limit - 1)
        block = int(tables[i, pos // block_size])
        slot = block * block_size + pos % block_size if step < limit else -1
        rows.append((pos, slot, pos + 1))
    return torch.tensor(rows, dtype=torch.int64).T


def test_a_chain_of_steps_selects_and_records_each_row(device: torch.device) -> None:
    steps, n, h, words, width, block_size = 3, 5, 700, 9, 6, 4  # n * h spans several programs
    gen = torch.Generator().manual_seed(0)
    first = torch.tensor([1, 7, 0, 13, 2])
    limits = torch.tensor([3, 1, 0, 2, 3])  # row 2 is padding; rows 1 and 3 stop early
    tables = torch.randperm(64, generator=gen)[: n * width].view(n, width).int()
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
    on = [t.to(device) for t in (first, limits, tables)]
    outputs = []
    for j in range(steps):
        select_step(step, cur, *on, block_size, now, masks, mask_now)
        assert int(cur) == j
        assert torch.equal(now.cpu(), expected_rows(j, first, limits, tables, block_size))
        assert torch.equal(mask_now, masks[j])
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


def test_select_step_without_masks(device: torch.device) -> None:
    first, limits = torch.tensor([5, 9], device=device), torch.tensor([4, 4], device=device)
    tables = torch.tensor([[3, 8, 1], [2, 6, 7]], dtype=torch.int32, device=device)
    step = torch.tensor([2], device=device)
    cur = torch.zeros(1, dtype=torch.int64, device=device)
    now = torch.empty(3, 2, dtype=torch.int64, device=device)
    select_step(step, cur, first, limits, tables, 4, now)
    # Positions 7 (page 1: block 8, offset 3) and 11 (page 2: block 7, offset 3).
    assert now.tolist() == [[7, 11], [35, 31], [8, 12]] and int(cur) == 2 and int(step) == 2


@pytest.mark.parametrize(
    "now,match",
    [
        (torch.empty(2, 3, dtype=torch.int64), "now must have shape"),
        (torch.empty(3, 3, dtype=torch.int32), "now must have dtype"),
    ],
)
def test_select_step_rejects_bad_buffers(now: torch.Tensor, match: str) -> None:
    index = torch.zeros(1, dtype=torch.int64)
    rows, tables = torch.zeros(3, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        select_step(index, index.clone(), rows, rows.clone(), tables, 4, now)


def test_expand_block_tables_widens_the_compact_rows(device: torch.device) -> None:
    n, w, big_n, big_w = 3, 5, 4, 700  # big_n * big_w spans several programs
    compact = torch.zeros(big_n * big_w, dtype=torch.int32, device=device)
    compact[: n * w] = torch.arange(1, n * w + 1, dtype=torch.int32, device=device)
    tables = torch.full((big_n, big_w), -7, dtype=torch.int32, device=device)
    expand_block_tables(torch.tensor([n, w], device=device), compact, tables)
    expected = torch.full((big_n, big_w), -7, dtype=torch.int32)
    expected[:n, :w] = torch.arange(1, n * w + 1, dtype=torch.int32).view(n, w)
    assert torch.equal(tables.cpu(), expected)


def test_record_step_rejects_a_mismatched_output() -> None:
    z = torch.zeros
    index = z(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="out_t must have shape"):
        record_step(
            index, index.clone(), z(2, 4), z(2, dtype=torch.int64), z(2), z(3, 2, 4),
            z(3, 5, dtype=torch.int64), z(3, 2), z(2, 4), z(2, dtype=torch.int64),
        )  # fmt: skip


# inf - inf is the NaN the kernel looks for; numpy, running it under the interpreter, warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_holding_a_nan_or_an_inf_is_stopped(device: torch.device, dtype) -> None:
    n, h = 6, 1500  # h spans two of the kernel's blocks
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, generator=gen).to(dtype)
    x[1, 1400] = float("nan")  # in the second block
    x[2, 0] = float("inf")
    x[3, 700] = -float("inf")
    x[4] = torch.finfo(dtype).max  # large is finite
    limits = torch.tensor([3, 3, 2, 1, 4, 0])
    expected = torch.where(x.float().isfinite().all(dim=1), limits, 0)
    on = limits.to(device)
    stop_nonfinite_rows(x.to(device), on)
    assert on.cpu().tolist() == expected.tolist() == [3, 0, 0, 0, 4, 0]
