"""admission: the hiddens' NaN/inf check made after the others (`Admitted.check_hiddens`,
as the engine makes it while the device drafts) refuses exactly the rows, with exactly
the errors, that the check made in its place refuses; over random steps against random
states (unknown, prefilling, pending or not, retried, stale), KV blocks plenty or short."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpdraft.service.engine import admission
from mtpdraft.service.engine.admission import Limits, admit
from mtpdraft.service.engine.block_pool import BlockPool
from mtpdraft.service.engine.errors import NotFound
from mtpdraft.service.engine.sampling import CHANGES
from mtpdraft.service.engine.state import StateTable
from mtpdraft.service.engine.step import Step

H, VOCAB, MAX_DRAFTS, SLOTS, B = 8, 50, 4, 16, 12
LIMITS = Limits(VOCAB, 36, MAX_DRAFTS, None)  # the longest states reach past it


def _table(rng: np.random.Generator, free_blocks: int) -> StateTable:
    held = rng.integers(2, 36, SLOTS)  # each state's rows
    pool = BlockPool(int((-(-held // 4)).sum()) + free_blocks)
    table = StateTable(SLOTS, 20, MAX_DRAFTS, 4, pool, (H, torch.float32, torch.device("cpu")))
    for slot, rows in enumerate(held.tolist()):
        table.take_slot(0.0)
        pending = rng.random() < 0.6
        count = int(rng.integers(1, MAX_DRAFTS + 1))
        if pending:
            table.pending_row[slot], table.pending_count[slot] = rows - count, count
            table.pending_computed[slot] = count
            table.pending_step[slot] = int(rng.integers(1, 4))
        table.num_rows[slot] = rows
        table.last_step[slot] = int(rng.integers(0, 4))
        table.prefilling[slot] = rng.random() < 0.1
        table.attach_blocks(slot, pool.allocate(-(-rows // 4)))
    return table


# What a usual step may get wrong in one row, one at a time (None: nothing).
ODD = (None, None, "unknown", "twice", "verdict", "position", "token", "k", "confidence",
       "stale", "retry", "prefilling", "late")  # fmt: skip


def _step(rng: np.random.Generator, table: StateTable, usual: bool) -> tuple[Step, np.ndarray]:
    """A random step and its rows' slots (-1: an unknown state); `usual`: one whose rows
    all pass but for their hiddens and, in one row, one of ODD."""
    slots = rng.permutation(SLOTS)[:B] if usual else rng.integers(-1, SLOTS, B)
    odd, i = (ODD[rng.integers(len(ODD))], int(rng.integers(B))) if usual else (None, 0)
    if odd in ("unknown", "twice"):
        slots[i] = -1 if odd == "unknown" else slots[(i + 1) % B]
    s = slots % SLOTS  # an unknown state (-1) reads the last slot's, as numpy does
    has, count = table.pending_row[s] >= 0, table.pending_count[s]
    if usual:
        table.prefilling[:] = odd == "prefilling" and np.arange(SLOTS) == s[i]
        a = np.where(has, np.minimum(rng.integers(0, MAX_DRAFTS, B), count), -1)
        a[i] = a[(i + 1) % B] if odd == "twice" else a[i]
        if odd == "verdict":  # too many drafts, a bad count, or a verdict on none / none
            a[i] = rng.choice([int(count[i]) + 1, -2, 0 if a[i] < 0 else -1])
    else:
        a = np.where(rng.random(B) < 0.7, rng.integers(-2, MAX_DRAFTS + 2, B), -1)
    verdict = a >= 0
    base = np.where(verdict, table.pending_row[s] + 1 + a, table.num_rows[s])
    positions = np.where(rng.random(B) < 0.8, base + 1, rng.integers(-1, 40, B))
    positions = np.where(rng.random(B) < 0.2, table.pending_row[s] + 1, positions)  # retries
    numbers = np.where(rng.random(B) < 0.5, rng.integers(0, 5, B), 0).astype(np.uint64)
    tokens = np.where(rng.random(B) < 0.9, rng.integers(0, VOCAB, B), VOCAB)
    k = np.where(rng.random(B) < 0.8, 2, rng.integers(-1, MAX_DRAFTS + 2, B))
    confidence = np.where(rng.random(B) < 0.9, 0.0, rng.choice([np.nan, 2.0, 0.5], B))
    if usual:
        positions, numbers, tokens, k = base + 1, numbers * 0, tokens % VOCAB, k * 0 + 2
        confidence = np.zeros(B)
        last, pending = int(table.last_step[s[i]]), int(table.pending_step[s[i]])
        odd_values = {
            "position": (positions, base[i] + rng.choice([-1, 1])),
            "token": (tokens, rng.choice([-1, VOCAB])),
            "k": (k, rng.choice([-1, 0, MAX_DRAFTS + 1])),
            "confidence": (confidence, rng.choice([np.nan, -0.5, 1.5])),
            "stale": (numbers, max(last, 1)),
            "retry": (numbers, pending),  # at the pending step's position, below
            "late": (positions, LIMITS.max_position),
        }
        if odd in odd_values:
            column, value = odd_values[odd]
            column[i] = value
        if odd == "retry":
            positions[i] = table.pending_row[s[i]] + 1
    hiddens = torch.randn(B, H, generator=torch.Generator().manual_seed(int(rng.integers(99))))
    bad = rng.random(B) < 0.4
    hiddens[torch.from_numpy(bad), int(rng.integers(H))] = float(rng.choice([np.nan, np.inf]))
    step = Step(
        state_ids=(slots + 100).astype(np.uint64),
        tokens=tokens.astype(np.int64),
        positions=positions.astype(np.int64),
        hiddens=hiddens,
        num_drafts=k.astype(np.int64),
        num_accepted=a.astype(np.int64),
        refeed_counts=np.zeros(B, np.int64),
        refeed_hiddens=None,
        mask_counts=np.zeros(B, np.int64),
        bitmasks=None,
        min_confidence=confidence.astype(np.float64),
        step_numbers=numbers.astype(np.uint64),
        sampling=np.zeros(B, CHANGES),
        draft_caps=rng.integers(-1, MAX_DRAFTS + 2, B),  # read where num_drafts is 0
        verify_costs=rng.choice([0.5, -1.0, np.nan], B),
        grammars=np.full(B, None, object),
    )
    return step, slots


def _why(errors: dict) -> dict:
    return {i: (type(e), e.reason, e.field, str(e)) for i, e in errors.items()}


@pytest.mark.parametrize("free_blocks", [1000, 0])
def test_the_hiddens_checked_last_refuse_as_checked_in_order(
    free_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also the usual step's few operations (admission._usual) against the checks row by
    row: it is taken only where they pass every row."""
    usual_found = admission._usual
    taken = []
    monkeypatch.setattr(
        admission, "_usual", lambda *args: taken.append(usual_found(*args)) or taken[-1]
    )
    rng = np.random.default_rng(free_blocks)
    seen = set()
    for i in range(600):
        table = _table(rng, free_blocks)
        step, slots = _step(rng, table, usual=i % 3 > 0)

        def not_found(state_id: int) -> NotFound:
            return NotFound(f"state {state_id}", reason="STATE_NOT_FOUND")

        now = admit(step, slots, table, LIMITS, not_found)
        later = admit(step, slots, table, LIMITS, not_found, check_hiddens=False)
        kept = later.check_hiddens(step)
        assert later.check_hiddens(step).all()  # made once
        assert np.array_equal(later.rows[kept], now.rows)
        assert np.array_equal(later.slots[kept], now.slots)
        assert np.array_equal(later.base_rows[kept], now.base_rows)
        assert np.array_equal(later.retried, now.retried)
        assert np.array_equal(later.retried_slots, now.retried_slots)
        assert _why(later.errors) == _why(now.errors)
        seen |= {e.reason for e in now.errors.values()}
        seen |= {"ran, refused later"} if not kept.all() else set()
        seen |= {"retried"} if len(now.retried) else set()
        usual = taken.pop() is not None
        assert not usual or (
            not len(now.retried)
            and set(now.errors) <= {i for i, e in now.errors.items() if e.reason == "NOT_FINITE"}
        )
        seen |= {"usual"} if usual else {"not usual"}
    # The cases the comparison is about were met: refused hiddens, beside the checks
    # before and after theirs, and rows that ran before theirs refused them.
    assert {"NOT_FINITE", "TOKEN_OUT_OF_RANGE", "POSITION_MISMATCH", "retried"} <= seen
    assert "not usual" in seen and ("usual" in seen or not free_blocks)
    assert "ran, refused later" in seen
    assert ("KV_BLOCKS_EXHAUSTED" in seen) == (free_blocks < 10)
