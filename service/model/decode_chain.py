"""Chained decode steps: each sequence's next rows, each fed the previous step's draft.

A proposal of K drafts is K steps of one row per sequence, and every step but the
first takes its inputs from the step before (the draft token, the output hidden).
Everything a chain needs is known before it starts (positions, KV slots, masks),
so the host describes the whole chain once (`ChainInputs`), the device runs it
without waiting, and the host waits once, for the results (`ChainOutputs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .sampling import RowSampling, SamplingParams


@dataclass
class ChainInputs:
    """n sequences, each to advance by limits[i] rows (one per step), described on the host.

    A sequence whose first hidden holds a NaN or an inf computes nothing of use and
    writes no KV: its caller may check the hiddens while the device drafts.
    """

    tokens: np.ndarray  # [n] int64: the first row's token
    hiddens: torch.Tensor  # [n, H]: the first row's hidden (host or device)
    positions: np.ndarray  # [n] int64: the first row's position
    limits: np.ndarray  # [n] int64, >= 1: rows to compute (and KV rows to write)
    block_tables: np.ndarray  # [n, width] int32: KV blocks covering every row written
    bitmasks: torch.Tensor | None = None  # [steps, n, W] int32: allowed tokens per step
    sampling: ChainSampling | None = None  # None: every draft greedy

    def __len__(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def steps(self) -> int:
        return int(self.limits.max())

    def step_rows(self, block_size: int, writes: np.ndarray | None = None) -> np.ndarray:
        """[steps, 3, n] int64: each step's positions, KV slots and context lengths.

        A sequence past its limit (or past `writes[i]` steps, where given) repeats its
        last row's position (a valid context) and writes nothing (slot -1): its later
        outputs are meaningless.
        """
        # In numpy, which keeps the GIL for arrays this small: a torch call lets go of
        # it, and the served engine thread then waits for the event loop to give it back.
        limits, width = self.limits[None, :], self.block_tables.shape[1]
        step = np.arange(self.steps)[:, None]
        positions = self.positions[None, :] + np.minimum(step, limits - 1)
        pages = np.minimum(positions // block_size, width - 1)
        blocks = np.take_along_axis(self.block_tables.T, pages, axis=0).astype(np.int64)
        written = limits if writes is None else writes[None, :]
        slots = np.where(step < written, blocks * block_size + positions % block_size, -1)
        return np.stack([positions, slots, positions + 1], axis=1)


@dataclass
class ChainSampling:
    """How each sequence's drafts are chosen (sampling.py), on the host: its parameters
    (temperature 0: greedy), its draws' seed and state words, and the proposal index of
    its chain's first draft (a step's draft index is that plus the step)."""

    temperature: np.ndarray  # [n] float
    top_k: np.ndarray  # [n] int64, 0: no cut
    top_p: np.ndarray  # [n] float, 1: no cut
    min_p: np.ndarray  # [n] float
    seeds: np.ndarray  # [n] int64 (a uint64 seed's bits)
    states: np.ndarray  # [n] int64
    first_index: np.ndarray  # [n] int64
    support: int

    def on(self, device: torch.device) -> tuple[RowSampling, torch.Tensor]:
        """(the rows' sampling, the first draft indexes) on `device`, in one copy."""
        ints = torch.from_numpy(
            np.stack([self.top_k, self.seeds, self.states, self.first_index]).astype(np.int64)
        ).to(device)
        floats = torch.from_numpy(
            np.stack([self.temperature, self.top_p, self.min_p]).astype(np.float32)
        ).to(device)
        params = SamplingParams(floats[0], ints[0], floats[1], floats[2])
        return RowSampling(params, ints[1], ints[2], self.support, self.wide), ints[3]

    @property
    def wide(self) -> bool:
        """Some row's top_k reaches past the support (the eager path ranks it whole)."""
        return bool((self.top_k > self.support).any())


@dataclass
class ChainOutputs:
    """Each step's output hiddens (on the device; valid until the next chain runs), drafts
    and their probabilities (host)."""

    hiddens: torch.Tensor  # [steps, n, H]
    tokens: np.ndarray  # [steps, n] int64
    probs: np.ndarray  # [steps, n] float32
    q_ids: np.ndarray | None = None  # [steps, n, support] int64 (sampled chains only)
    q_probs: np.ndarray | None = None  # [steps, n, support] float32


# Host work a caller runs while the device computes a chain (the host would otherwise
# only wait): called once the chain is queued, with its steps' output hiddens
# [steps, n, H], which are still being written, so only device work queued after the
# chain may read them.
BeforeWait = Callable[[torch.Tensor], None]
