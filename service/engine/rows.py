"""Turns "compute these rows of these states" into one MTP forward."""

from __future__ import annotations

from dataclasses import dataclass

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
    hiddens: torch.Tensor  # [n, H] on the model's device


def block_tables(states: list[DrafterState], device: torch.device) -> torch.Tensor:
    """[len(states), widest] int32: each state's KV blocks, padded with zeros."""
    tables = torch.zeros((len(states), max(len(s.blocks) for s in states)), dtype=torch.int32)
    for i, state in enumerate(states):
        tables[i, : len(state.blocks)] = torch.tensor(state.blocks, dtype=torch.int32)
    return tables.to(device)


def _row_batch(head: MTPHead, kv: KVCache, segments: list[Segment]) -> RowBatch:
    device, bs = head.device, kv.block_size
    positions, slots, seq_ids, tokens = [], [], [], []
    for i, seg in enumerate(segments):
        rows = range(seg.start_row, seg.start_row + len(seg.tokens))
        positions.extend(rows)
        slots.extend(seg.state.blocks[r // bs] * bs + r % bs for r in rows)
        seq_ids.extend([i] * len(rows))
        tokens.extend(seg.tokens)
    return RowBatch(
        tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
        hiddens=torch.cat([seg.hiddens for seg in segments]).to(device=device, dtype=head.dtype),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        seq_ids=torch.tensor(seq_ids, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables([seg.state for seg in segments], device),
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

    Returns (last rows' output hiddens [S, H], drafts [S], probabilities [S]). A
    step of one row per state (every chained draft, and most first drafts) runs
    as head.decode: a CUDA graph replay on the GPU.
    """
    batch = _row_batch(head, kv, segments)
    if all(len(seg.tokens) == 1 for seg in segments):
        return head.decode(batch, kv, bitmask)
    out = head.forward(batch, kv)
    ends = torch.tensor([len(seg.tokens) for seg in segments], device=out.device).cumsum(0) - 1
    last = out[ends]
    tokens, probs = head.draft(last, bitmask)
    return last, tokens, probs
