"""What the engine keeps per sequence (a state) and per detached KV (a handle)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class PendingProposal:
    """A proposal awaiting its verdict.

    Rows R0 (the committed row of the proposed token) .. R(rows_computed - 1)
    sit in the KV from row index first_row on; R(j) for j >= 1 is the
    speculative row (draft j, output hidden of R(j - 1)).
    """

    first_row: int
    drafts: list[int]
    rows_computed: int
    last_hidden: torch.Tensor  # [H]: output hidden of the last computed row


@dataclass
class DrafterState:
    """One sequence: its KV blocks, the rows they hold, and its place in the step cycle."""

    id: int
    last_used: float
    owner: str = ""  # who allocated it (the client's host), for the per-owner limit
    blocks: list[int] = field(default_factory=list)  # changed only by the methods below
    num_rows: int = 0  # rows in the KV, speculative ones of a pending proposal included
    pending: PendingProposal | None = None
    prefilling: bool = False  # a Prefill stream is open on it
    _block_row: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def next_position(self) -> int:
        """Position of the next row's token (rows are numbered by their hidden's position)."""
        return self.num_rows + 1

    def add_blocks(self, blocks: list[int]) -> None:
        if blocks:
            self.blocks.extend(blocks)
            self._block_row = None

    def drop_blocks(self, keep: int) -> list[int]:
        """Keeps the first `keep` blocks; returns the others."""
        dropped = self.blocks[keep:]
        if dropped:
            del self.blocks[keep:]
            self._block_row = None
        return dropped

    def replace_blocks(self, blocks: list[int]) -> list[int]:
        """Holds `blocks` from now on; returns the blocks held until now."""
        old, self.blocks, self._block_row = self.blocks, blocks, None
        return old

    def block_row(self) -> np.ndarray:
        """The blocks as int32, made again only after they change: a block table
        filled from these took 94 us for 64 states of 220 blocks, 713 us from the
        lists, in one C call that holds the GIL (served at 64 streams on an H200,
        that fill was 15% of the engine thread's time holding the GIL)."""
        if self._block_row is None:
            self._block_row = np.array(self.blocks, dtype=np.int32)
        return self._block_row


@dataclass
class KVHandle:
    """KV detached from a state by TakeKV, waiting for InstallKV until expires_at."""

    id: int
    blocks: list[int]
    num_rows: int
    expires_at: float
