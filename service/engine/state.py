"""What the engine keeps per sequence (a state), in arrays indexed by the state's slot.

A batch of B states reads and writes its bookkeeping (rows held, the pending
proposal, the KV block table, the last output hidden) with a handful of array
operations over the B slots, not B Python objects. `DrafterState` is a view of
one slot, for the calls that touch one state (Prefill, AfterVerify, TakeKV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import draft_count
from .block_pool import BlockPool
from .sampling import GREEDY, PARAMS

if TYPE_CHECKING:
    from ..grammar.spec import HeldGrammar


class StateTable:
    """The bookkeeping of up to `capacity` states; a state holds one slot while it lives."""

    def __init__(
        self,
        capacity: int,
        max_blocks: int,
        max_drafts: int,
        block_size: int,
        pool: BlockPool,
        hidden: tuple[int, torch.dtype, torch.device],
    ) -> None:
        size, dtype, device = hidden
        self.block_size = block_size
        self.pool = pool
        self.num_rows = np.zeros(capacity, np.int64)  # rows in the KV, pending ones included
        self.prefilling = np.zeros(capacity, bool)  # a Prefill stream is open on it
        self.last_used = np.zeros(capacity, np.float64)
        # The pending proposal: R0's row index (-1: none), its drafts, rows computed.
        self.pending_row = np.full(capacity, -1, np.int64)
        self.pending_count = np.zeros(capacity, np.int64)
        self.pending_drafts = np.zeros((capacity, max_drafts), np.int64)
        self.pending_computed = np.zeros(capacity, np.int64)
        self.pending_probs = np.zeros((capacity, max_drafts), np.float32)
        # Per depth j, its proposals whose first j + 1 drafts its verifier accepted and
        # those their probabilities predicted, summed with a decay (draft_count.py).
        self.accepted_sum = np.zeros((capacity, max_drafts), np.float64)
        self.predicted_sum = np.zeros((capacity, max_drafts), np.float64)
        # What the pending proposal was answered besides its drafts and their probabilities,
        # and the number of the step that made it (0: none), so that a retry of that step
        # is answered again; the highest step number applied, below which a step is stale.
        self.pending_confidence = np.zeros(capacity, np.float64)
        self.pending_step = np.zeros(capacity, np.uint64)
        self.last_step = np.zeros(capacity, np.uint64)
        # slot -> the q support of its pending proposal's drafts (ids, probs), if sampled.
        self.pending_q: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # slot -> the grammar's masks answered with its pending proposal ([count + 1, W]).
        self.pending_masks: dict[int, torch.Tensor] = {}
        self.sampling = np.zeros(capacity, PARAMS)  # how its drafts are chosen (sampling.py)
        # Output hidden of its last computed row: the hidden of the row of the last
        # draft, should all drafts be accepted.
        self.last_hidden = torch.zeros(capacity, size, dtype=dtype, device=device)
        self.blocks = np.zeros((capacity, max_blocks), np.int32)
        self.num_blocks = np.zeros(capacity, np.int64)
        self._free_slots = list(range(capacity - 1, -1, -1))
        # Slots as an index on a GPU, copied through pinned memory: the host does not
        # wait for the copy, nor for the device work queued before it.
        self._index_host = self._index = None
        if device.type == "cuda":
            self._index_host = torch.zeros(capacity, dtype=torch.int64).pin_memory()
            self._index = torch.zeros(capacity, dtype=torch.int64, device=device)

    @property
    def max_blocks(self) -> int:
        return self.blocks.shape[1]

    def take_slot(self, now: float) -> int:
        slot = self._free_slots.pop()
        self.num_rows[slot] = self.num_blocks[slot] = 0
        self.prefilling[slot] = False
        self.pending_row[slot] = -1
        self.accepted_sum[slot] = self.predicted_sum[slot] = 0
        self.pending_step[slot] = self.last_step[slot] = 0
        self.pending_q.pop(slot, None)
        self.pending_masks.pop(slot, None)
        self.sampling[slot] = tuple(getattr(GREEDY, name) for name in PARAMS.names)
        self.last_used[slot] = now
        return slot

    def count_verdicts(self, slots: np.ndarray, accepted: np.ndarray) -> None:
        """Adds verdicts on the slots' pending proposals to their decayed sums."""
        probs, counts = self.pending_probs[slots], self.pending_count[slots]
        hit, predicted = draft_count.verdicts(probs, counts, accepted)
        self.accepted_sum[slots] = draft_count.DECAY * self.accepted_sum[slots] + hit
        self.predicted_sum[slots] = draft_count.DECAY * self.predicted_sum[slots] + predicted

    def calibration(self, slots: np.ndarray) -> np.ndarray:
        return draft_count.calibration(self.accepted_sum[slots], self.predicted_sum[slots])

    def set_sampling(self, slots: np.ndarray, changes: np.ndarray) -> None:
        """The slots take the sampling of their rows of a step's changes column that are set."""
        changed = changes["set"]
        if changed.any():
            for name in PARAMS.names:
                self.sampling[name][slots[changed]] = changes[name][changed]

    def release_slot(self, slot: int) -> None:
        self.pool.free(self.detach_blocks(slot))
        self._free_slots.append(slot)

    def blocks_for(self, rows: np.ndarray | int) -> np.ndarray | int:
        return -(-rows // self.block_size)

    def extra_blocks(self, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Blocks each slot lacks to hold `rows` rows."""
        return np.maximum(self.blocks_for(rows) - self.num_blocks[slots], 0)

    def grow(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Gives each slot the blocks it lacks for its rows; the pool must hold them all."""
        extra = self.extra_blocks(slots, rows)
        growing = np.flatnonzero(extra)
        if not len(growing):
            return
        s, n = slots[growing], extra[growing]
        held = self.num_blocks[s]
        taken = np.asarray(self.pool.allocate(int(n.sum())), np.int32)
        # Each growing slot's new blocks go after the ones it holds, in the order taken.
        nth = np.arange(len(taken)) - np.repeat(np.cumsum(n) - n, n)
        self.blocks[np.repeat(s, n), np.repeat(held, n) + nth] = taken
        self.num_blocks[s] = held + n

    def trim(self, slots: np.ndarray) -> None:
        """Returns to the pool the blocks past each slot's rows."""
        self.shrink(slots, self.blocks_for(self.num_rows[slots]))

    def shrink(self, slots: np.ndarray, keep: np.ndarray) -> None:
        """Returns to the pool the blocks of each slot past its first keep[i]."""
        for i in np.flatnonzero(self.num_blocks[slots] > keep):
            slot = slots[i]
            self.pool.free(self.blocks[slot, keep[i] : self.num_blocks[slot]].tolist())
            self.num_blocks[slot] = keep[i]

    def detach_blocks(self, slot: int) -> list[int]:
        """The slot's blocks, which it holds no more."""
        blocks = self.blocks[slot, : self.num_blocks[slot]].tolist()
        self.num_blocks[slot] = 0
        return blocks

    def attach_blocks(self, slot: int, blocks: list[int]) -> None:
        """Holds `blocks` (the slot holds none)."""
        self.blocks[slot, : len(blocks)] = blocks
        self.num_blocks[slot] = len(blocks)

    def device_index(self, slots: np.ndarray) -> torch.Tensor:
        """`slots` on the device of `last_hidden`, for device work queued after this call.
        The pinned buffer is free again: the previous batch's wait covered its copy."""
        if self._index is None:
            return torch.from_numpy(slots)
        n = len(slots)
        self._index_host.numpy()[:n] = slots
        return self._index[:n].copy_(self._index_host[:n], non_blocking=True)

    def block_tables(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots), widest] int32: the slots' blocks, padded with zeros past each one's."""
        width = max(int(self.num_blocks[slots].max()), 1)
        return self.blocks[slots, :width]

    def kv_slots(self, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The flat KV slot (block * block_size + offset) of row `rows[i]` of `slots[i]`."""
        bs = self.block_size
        return self.blocks[slots, rows // bs].astype(np.int64) * bs + rows % bs


@dataclass
class PendingProposal:
    """A proposal awaiting its verdict, as StateTable keeps it (read, for a look at a state).

    Rows R0 (the committed row of the proposed token) .. R(rows_computed - 1)
    sit in the KV from row index first_row on; R(j) for j >= 1 is the
    speculative row (draft j, output hidden of R(j - 1)).
    """

    first_row: int
    drafts: list[int]
    rows_computed: int


class DrafterState:
    """One live state: its id, owner (the client's host, for the per-owner limit) and slot."""

    __slots__ = ("id", "owner", "slot", "table")

    def __init__(self, state_id: int, owner: str, slot: int, table: StateTable) -> None:
        self.id, self.owner, self.slot, self.table = state_id, owner, slot, table

    @property
    def num_rows(self) -> int:
        return int(self.table.num_rows[self.slot])

    @num_rows.setter
    def num_rows(self, rows: int) -> None:
        self.table.num_rows[self.slot] = rows

    @property
    def next_position(self) -> int:
        """Position of the next row's token (rows are numbered by their hidden's position)."""
        return self.num_rows + 1

    @property
    def prefilling(self) -> bool:
        return bool(self.table.prefilling[self.slot])

    @prefilling.setter
    def prefilling(self, value: bool) -> None:
        self.table.prefilling[self.slot] = value

    @property
    def pending(self) -> PendingProposal | None:
        t, s = self.table, self.slot
        if t.pending_row[s] < 0:
            return None
        drafts = t.pending_drafts[s, : t.pending_count[s]].tolist()
        return PendingProposal(int(t.pending_row[s]), drafts, int(t.pending_computed[s]))

    @property
    def blocks(self) -> list[int]:
        return self.table.blocks[self.slot, : self.table.num_blocks[self.slot]].tolist()

    def kv_slots(self, rows: np.ndarray) -> np.ndarray:
        """The flat KV slot of each of its rows (its blocks must hold them)."""
        return self.table.kv_slots(np.full(len(rows), self.slot), rows)

    def touch(self, now: float) -> None:
        self.table.last_used[self.slot] = now

    def trim(self) -> None:
        self.table.trim(np.array([self.slot]))


@dataclass
class KVHandle:
    """KV detached from a state by TakeKV, waiting for InstallKV until expires_at."""

    id: int
    blocks: list[int]
    num_rows: int
    expires_at: float
    grammar: HeldGrammar | None = None  # the state's grammar, which InstallKV restores
