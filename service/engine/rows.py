"""Turns "compute these rows of these states" into one MTP forward."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model.batch import RowBatch
from ..model.kv_cache import KVCache
from ..model.mtp_head import MTPHead
from .state import DrafterState


@dataclass
class Segment:
    """Rows start_row .. start_row + n - 1 of one state, with their inputs."""

    state: DrafterState
    start_row: int
    tokens: list[int]
    hiddens: torch.Tensor  # [n, H], on the host or the model's device


def block_tables(states: list[DrafterState]) -> torch.Tensor:
    """[len(states), widest] int32 on the host: each state's KV blocks, padded with zeros."""
    # Filled through numpy from each state's cached int32 row (DrafterState.block_row).
    tables = np.zeros((len(states), max(len(s.blocks) for s in states)), dtype=np.int32)
    for i, state in enumerate(states):
        row = state.block_row()
        tables[i, : len(row)] = row
    return torch.from_numpy(tables)


def _row_batch(head: MTPHead, kv: KVCache, segments: list[Segment]) -> RowBatch:
    device, bs = head.device, kv.block_size
    positions, slots, seq_ids, tokens = [], [], [], []
    for i, seg in enumerate(segments):
        rows = range(seg.start_row, seg.start_row + len(seg.tokens))
        positions.extend(rows)
        slots.extend(seg.state.blocks[r // bs] * bs + r % bs for r in rows)
        seq_ids.extend([i] * len(rows))
        tokens.extend(seg.tokens)
    # The integer inputs travel in one host-to-device copy.
    ints = torch.tensor(
        [tokens, positions, slots, [p + 1 for p in positions], seq_ids], dtype=torch.int64
    ).to(device)
    return RowBatch(
        tokens=ints[0],
        hiddens=torch.cat([seg.hiddens.to(device, head.dtype) for seg in segments]),
        positions=ints[1],
        seq_ids=ints[4].int(),
        slot_mapping=ints[2],
        block_tables=block_tables([seg.state for seg in segments]).to(device),
        context_lens=ints[3],
    )


def run_segments(head: MTPHead, kv: KVCache, segments: list[Segment]) -> list[torch.Tensor]:
    """Computes every segment's rows in one forward; returns each segment's output hiddens.

    The states' blocks must already cover the rows. Rows of one segment attend
    each other causally and every earlier row of their state.
    """
    out = head.forward(_row_batch(head, kv, segments), kv)
    return list(out.split([len(seg.tokens) for seg in segments]))


def draft_segments(
    head: MTPHead, kv: KVCache, segments: list[Segment], bitmask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Computes the segments' rows and drafts from each segment's last row.

    Returns (last rows' output hiddens [S, H], drafts [S], probabilities [S]).
    """
    out = head.forward(_row_batch(head, kv, segments), kv)
    ends = torch.tensor([len(seg.tokens) for seg in segments]).cumsum(0) - 1
    last = out[ends.to(out.device)]
    tokens, probs = head.draft(last, bitmask)
    return last, tokens, probs
