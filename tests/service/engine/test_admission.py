"""admission: the hiddens' NaN/inf check made after the others (`Admitted.check_hiddens`,
as the engine makes it while the device drafts) refuses exactly the rows, with exactly
the errors, that the check made in its place refuses; over random steps against random
states (unknown, prefilling, pending or not, retried, stale), KV blocks plenty or short."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpdraft.service.engine.admission import Limits, admit
from mtpdraft.service.engine.block_pool import BlockPool
from mtpdraft.service.engine.errors import NotFound
from mtpdraft.service.engine.sampling import CHANGES
from mtpdraft.service.engine.state import StateTable
from mtpdraft.service.engine.step import Step

H, VOCAB, MAX_DRAFTS, SLOTS, B = 8, 50, 4, 10, 12
LIMITS = Limits(VOCAB, 64, MAX_DRAFTS, None)


def _table(rng: np.random.Generator, free_blocks: int) -> StateTable:
    held = rng.integers(2, 30, SLOTS)  # each state's rows
    pool = BlockPool(int((-(-held // 4)).sum()) + free_blocks)
    table = StateTable(SLOTS, 16, MAX_DRAFTS, 4, pool, (H, torch.float32, torch.device("cpu")))
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


def _step(rng: np.random.Generator, table: StateTable) -> tuple[Step, np.ndarray]:
    """A random step and its rows' slots (-1: an unknown state)."""
    slots = rng.integers(-1, SLOTS, B)  # repeats: duplicates
    s = np.maximum(slots, 0)
    a = np.where(rng.random(B) < 0.7, rng.integers(-2, MAX_DRAFTS + 2, B), -1)
    verdict = a >= 0
    base = np.where(verdict, table.pending_row[s] + 1 + a, table.num_rows[s])
    positions = np.where(rng.random(B) < 0.8, base + 1, rng.integers(-1, 40, B))
    positions = np.where(rng.random(B) < 0.2, table.pending_row[s] + 1, positions)  # retries
    hiddens = torch.randn(B, H, generator=torch.Generator().manual_seed(int(rng.integers(99))))
    bad = rng.random(B) < 0.4
    hiddens[torch.from_numpy(bad), int(rng.integers(H))] = float(rng.choice([np.nan, np.inf]))
    numbers = np.where(rng.random(B) < 0.5, rng.integers(0, 5, B), 0).astype(np.uint64)
    step = Step(
        state_ids=(slots + 100).astype(np.uint64),
        tokens=np.where(rng.random(B) < 0.9, rng.integers(0, VOCAB, B), VOCAB),
        positions=positions.astype(np.int64),
        hiddens=hiddens,
        num_drafts=np.where(rng.random(B) < 0.8, 2, rng.integers(-1, MAX_DRAFTS + 2, B)),
        num_accepted=a.astype(np.int64),
        refeed_counts=np.zeros(B, np.int64),
        refeed_hiddens=None,
        mask_counts=np.zeros(B, np.int64),
        bitmasks=None,
        min_confidence=np.where(rng.random(B) < 0.9, 0.0, rng.choice([np.nan, 2.0, 0.5], B)),
        step_numbers=numbers,
        sampling=np.zeros(B, CHANGES),
        draft_caps=rng.integers(-1, MAX_DRAFTS + 2, B),  # read where num_drafts is 0
        verify_costs=rng.choice([0.5, -1.0, np.nan], B),
        grammars=np.full(B, None, object),
    )
    return step, slots


def _why(errors: dict) -> dict:
    return {i: (type(e), e.reason, e.field, str(e)) for i, e in errors.items()}


@pytest.mark.parametrize("free_blocks", [1000, 0])
def test_the_hiddens_checked_last_refuse_as_checked_in_order(free_blocks: int) -> None:
    rng = np.random.default_rng(free_blocks)
    seen = set()
    for _ in range(300):
        table = _table(rng, free_blocks)
        step, slots = _step(rng, table)

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
    # The cases the comparison is about were met: refused hiddens, beside the checks
    # before and after theirs, and rows that ran before theirs refused them.
    assert {"NOT_FINITE", "TOKEN_OUT_OF_RANGE", "POSITION_MISMATCH", "retried"} <= seen
    assert "ran, refused later" in seen
    assert ("KV_BLOCKS_EXHAUSTED" in seen) == (free_blocks < 10)
