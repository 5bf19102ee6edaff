"""DrafterState's blocks: every change goes through its methods, which keep the cached row true."""

from __future__ import annotations

import numpy as np

from mtpdraft.service.engine.state import DrafterState


def test_the_block_row_follows_every_change() -> None:
    state = DrafterState(id=1, last_used=0.0)
    assert state.block_row().dtype == np.int32 and state.block_row().tolist() == []
    state.add_blocks([7, 3])
    row = state.block_row()
    assert row.tolist() == [7, 3] and state.block_row() is row  # made once, then reused
    state.add_blocks([])
    assert state.block_row() is row
    state.add_blocks([9])
    assert state.block_row().tolist() == [7, 3, 9]
    # Dropped from the end and grown again to the same length, other blocks: a cache
    # keyed on the length alone would be stale here.
    assert state.drop_blocks(1) == [3, 9]
    assert state.drop_blocks(5) == []
    state.add_blocks([4, 8])
    assert state.block_row().tolist() == [7, 4, 8] == state.blocks
    assert state.replace_blocks([5]) == [7, 4, 8]
    assert state.block_row().tolist() == [5] == state.blocks
