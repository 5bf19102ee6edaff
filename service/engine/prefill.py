"""An open Prefill stream: rows arrive in chunks; abort() puts the state back as it was.

A session sees the engine that opened it only as a `RowStore`, so that the engine
imports this module and this module imports nothing of the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from .types import RowCount

if TYPE_CHECKING:
    from .state import DrafterState


class RowStore(Protocol):
    """What a Prefill asks of the engine that opened it: its states, and rows checked,
    reserved and computed."""

    states: Mapping[int, DrafterState]  # the live states by id, looked up as they are

    def state(self, state_id: int) -> DrafterState:
        """The live state, its lease renewed; NOT_FOUND if there is none."""

    def prefill_rows(self, tokens: Sequence[int], hiddens: torch.Tensor) -> torch.Tensor:
        """A chunk's hiddens as [len(tokens), H], its tokens and hiddens checked."""

    def reserve(self, state: DrafterState, rows: int, field: str) -> None:
        """Grows the state's blocks to hold `rows` rows, or refuses naming `field`."""

    def compute_rows(self, state: DrafterState, tokens: np.ndarray, hiddens: torch.Tensor) -> None:
        """Appends committed rows to the state, whose blocks hold them."""


class PrefillSession:
    """An open Prefill: rows arrive in chunks; abort() puts the state back as it was."""

    def __init__(self, store: RowStore, state: DrafterState) -> None:
        self.store = store
        self.state_id = state.id
        self.rows_before = state.num_rows
        state.prefilling = True

    def append(self, tokens: Sequence[int], hiddens: torch.Tensor) -> None:
        """Appends a chunk's rows, its values checked before the state."""
        self.append_rows(tokens, self.store.prefill_rows(tokens, hiddens))

    def append_rows(self, tokens: Sequence[int], hiddens: torch.Tensor) -> None:
        """Appends checked rows ([len(tokens), H] hiddens)."""
        store, state = self.store, self.store.state(self.state_id)  # renews its lease
        if not tokens:
            return
        store.reserve(state, state.num_rows + len(tokens), "tokens")
        store.compute_rows(state, np.asarray(tokens, np.int64), hiddens)

    def finish(self) -> RowCount:
        state = self.store.state(self.state_id)
        state.prefilling = False
        return RowCount(state.num_rows, state.next_position)

    def abort(self) -> None:
        state = self.store.states.get(self.state_id)
        if state is None:
            return
        state.prefilling = False
        state.num_rows = self.rows_before
        state.trim()
