"""A proposal in the making: how a verdict changes a state, and one state's chain of drafts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import Segment
from .state import DrafterState
from .types import ProposeArgs


@dataclass
class VerdictPlan:
    """How a verdict changes a state: truncate, then (maybe) compute rows."""

    keep_rows: int
    recompute: Segment | None
    rows_after: int


@dataclass
class Chain:
    """One state's proposal while its drafts are being chained."""

    args: ProposeArgs
    state: DrafterState
    base_row: int  # row index of R0
    bitmask: torch.Tensor | None  # [n, W]
    last_hidden: torch.Tensor | None = None
    rows_computed: int = 0
    chain: float = 1.0
    stopped: bool = False

    def __post_init__(self) -> None:
        self.drafts: list[int] = []
        self.probs: list[float] = []

    @property
    def done(self) -> bool:
        return self.stopped or len(self.drafts) == self.args.num_drafts

    def next_input(self) -> tuple[int, torch.Tensor, int]:
        """(token, hidden [H] or [1, H], row index) of the chain's next row."""
        if self.rows_computed == 0:
            return self.args.token, self.args.hidden, self.base_row
        assert self.last_hidden is not None
        return self.drafts[-1], self.last_hidden, self.base_row + self.rows_computed

    def mask_row(self) -> torch.Tensor | None:
        if self.bitmask is None:
            return None
        return self.bitmask[min(len(self.drafts), self.bitmask.shape[0] - 1)]

    def take(self, token: int, prob: float) -> None:
        chain = min(self.chain, prob)
        self.chain = chain
        if self.args.min_confidence > 0 and chain < self.args.min_confidence:
            self.stopped = True
            return
        self.drafts.append(token)
        self.probs.append(prob)
