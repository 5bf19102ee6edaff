"""StateTable's blocks: grown, trimmed, detached and attached per slot, all from one pool."""

from __future__ import annotations

import numpy as np
import torch

from mtpdraft.service.engine.block_pool import BlockPool
from mtpdraft.service.engine.state import StateTable


def _table(blocks: int = 10) -> StateTable:
    pool = BlockPool(blocks)
    return StateTable(4, 8, 4, 4, pool, (8, torch.float32, torch.device("cpu")))


def _held(table: StateTable, slot: int) -> list[int]:
    return table.blocks[slot, : table.num_blocks[slot]].tolist()


def test_blocks_follow_rows_and_return_to_the_pool() -> None:
    table = _table()
    a, b = table.take_slot(0.0), table.take_slot(0.0)
    slots = np.array([a, b])
    table.grow(slots, np.array([5, 1]))  # 2 blocks of 4 rows, and 1
    assert [len(_held(table, a)), len(_held(table, b))] == [2, 1]
    assert len(set(_held(table, a) + _held(table, b))) == 3 and table.pool.num_free == 7
    table.grow(slots, np.array([8, 1]))  # no new block: 8 rows fit in 2
    assert table.pool.num_free == 7
    tables = table.block_tables(slots)
    assert tables.shape == (2, 2) and tables[1, 1] == 0  # padded past b's one block
    first = _held(table, a)[0]
    assert table.kv_slots(np.array([a]), np.array([2]))[0] == first * 4 + 2
    table.num_rows[slots] = [3, 0]
    table.trim(slots)
    assert _held(table, a) == [first] and _held(table, b) == [] and table.pool.num_free == 9
    moved = table.detach_blocks(a)
    assert moved == [first] and table.num_blocks[a] == 0
    table.attach_blocks(b, moved)
    assert _held(table, b) == [first]
    table.release_slot(b)
    table.release_slot(a)
    assert table.pool.num_free == 10


def test_a_reused_slot_starts_empty() -> None:
    table = _table()
    slot = table.take_slot(0.0)
    table.grow(np.array([slot]), np.array([6]))
    table.num_rows[slot], table.pending_row[slot], table.prefilling[slot] = 6, 2, True
    table.release_slot(slot)
    again = table.take_slot(1.0)
    assert again == slot
    assert table.num_rows[slot] == 0 and table.pending_row[slot] == -1
    assert not table.prefilling[slot] and table.num_blocks[slot] == 0
    assert table.pool.num_free == 10 and table.last_used[slot] == 1.0


def test_slots_growing_together_keep_their_blocks_and_take_new_ones_in_order() -> None:
    """Slots growing by different counts in one call (one not at all): each keeps what it
    holds and appends its new blocks, handed out low indices first, slot by slot."""
    table = _table(12)
    a, b, c = (table.take_slot(0.0) for _ in range(3))
    slots = np.array([a, b, c])
    table.grow(slots, np.array([4, 0, 5]))  # 1 block, none, 2
    assert [_held(table, s) for s in slots] == [[0], [], [1, 2]]
    table.grow(slots, np.array([12, 1, 8]))  # 2 more, 1, none
    assert [_held(table, s) for s in slots] == [[0, 3, 4], [5], [1, 2]]
    assert table.pool.num_free == 6
