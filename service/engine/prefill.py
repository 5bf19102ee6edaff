"""An open Prefill stream: rows arrive in chunks; abort() puts the state back as it was."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import validation as check
from .rows import Segment, run_segments
from .state import DrafterState
from .types import RowCount

if TYPE_CHECKING:
    from .engine import DraftEngine


class PrefillSession:
    """An open Prefill: rows arrive in chunks; abort() puts the state back as it was."""

    def __init__(self, engine: DraftEngine, state: DrafterState) -> None:
        self.engine = engine
        self.state_id = state.id
        self.rows_before = state.num_rows
        state.prefilling = True

    def _live_state(self) -> DrafterState:
        return self.engine._state(self.state_id)

    def append(self, tokens: list[int], hiddens: torch.Tensor) -> None:
        engine, state = self.engine, self._live_state()
        c = engine.head.config
        check.check_tokens(tokens, c.vocab_size, "tokens")
        hiddens = check.check_hiddens(hiddens, len(tokens), c.hidden_size, "hiddens")
        if not tokens:
            return
        engine._check_rows_fit(state.num_rows + len(tokens) - 1, "tokens")
        engine._reserve([(state, state.num_rows + len(tokens))])
        step = engine.prefill_rows_per_forward
        for lo in range(0, len(tokens), step):
            rows = hiddens[lo : lo + step]  # moved to the device with the batch's inputs
            segment = Segment(state, state.num_rows, tokens[lo : lo + step], rows)
            run_segments(engine.head, engine.kv, [segment])
            state.num_rows += rows.shape[0]

    def finish(self) -> RowCount:
        state = self._live_state()
        state.prefilling = False
        return RowCount(state.num_rows, state.next_position)

    def abort(self) -> None:
        state = self.engine.states.get(self.state_id)
        if state is None:
            return
        state.prefilling = False
        state.num_rows = self.rows_before
        self.engine._trim(state)
