"""What the engine keeps per sequence (a state) and per detached KV (a handle)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    blocks: list[int] = field(default_factory=list)
    num_rows: int = 0  # rows in the KV, speculative ones of a pending proposal included
    pending: PendingProposal | None = None
    prefilling: bool = False  # a Prefill stream is open on it

    @property
    def next_position(self) -> int:
        """Position of the next row's token (rows are numbered by their hidden's position)."""
        return self.num_rows + 1


@dataclass
class KVHandle:
    """KV detached from a state by TakeKV, waiting for InstallKV until expires_at."""

    id: int
    blocks: list[int]
    num_rows: int
    expires_at: float
