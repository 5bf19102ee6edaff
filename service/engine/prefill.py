"""An open Prefill stream: rows arrive in chunks; abort() puts the state back as it was."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .types import RowCount

if TYPE_CHECKING:
    from .engine import DraftEngine
    from .state import DrafterState


class PrefillSession:
    """An open Prefill: rows arrive in chunks; abort() puts the state back as it was."""

    def __init__(self, engine: DraftEngine, state: DrafterState) -> None:
        self.engine = engine
        self.state_id = state.id
        self.rows_before = state.num_rows
        state.prefilling = True

    def append(self, tokens: Sequence[int], hiddens: torch.Tensor) -> None:
        """Appends a chunk's rows, its values checked before the state."""
        self.append_rows(tokens, self.engine.prefill_rows(tokens, hiddens))

    def append_rows(self, tokens: Sequence[int], hiddens: torch.Tensor) -> None:
        """Appends checked rows ([len(tokens), H] hiddens)."""
        engine, state = self.engine, self.engine.state(self.state_id)  # renews its lease
        if not tokens:
            return
        engine.reserve(state, state.num_rows + len(tokens), "tokens")
        engine.compute_rows(state, np.asarray(tokens, np.int64), hiddens)

    def finish(self) -> RowCount:
        state = self.engine.state(self.state_id)
        state.prefilling = False
        return RowCount(state.num_rows, state.next_position)

    def abort(self) -> None:
        state = self.engine.states.get(self.state_id)
        if state is None:
            return
        state.prefilling = False
        state.num_rows = self.rows_before
        state.trim()
