"""Turns "compute these rows of these states" into one MTP forward."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model.batch import RowBatch
from ..model.decode_chain import ChainSampling
from ..model.kv_cache import KVCache
from ..model.mtp_head import MTPHead
from ..model.sampling import Selected
from .state import StateTable


@dataclass
class Segment:
    """Rows start_row .. start_row + n - 1 of the state in `slot`, with their inputs."""

    slot: int
    start_row: int
    tokens: np.ndarray  # [n] int64
    hiddens: torch.Tensor  # [n, H], on the host or the model's device


def _row_batch(head: MTPHead, table: StateTable, segments: list[Segment]) -> RowBatch:
    lengths = np.array([len(seg.tokens) for seg in segments])
    slots = np.array([seg.slot for seg in segments])
    rows = np.concatenate([np.arange(s.start_row, s.start_row + len(s.tokens)) for s in segments])
    owner = np.repeat(np.arange(len(segments)), lengths)
    tokens = np.concatenate([seg.tokens for seg in segments])
    kv_slots = table.kv_slots(slots[owner], rows)
    # The integer inputs travel in one host-to-device copy.
    ints = torch.from_numpy(np.stack([tokens, rows, kv_slots, rows + 1, owner])).to(head.device)
    hiddens = [seg.hiddens.to(head.device, head.dtype) for seg in segments]
    return RowBatch(
        tokens=ints[0],
        hiddens=hiddens[0] if len(hiddens) == 1 else torch.cat(hiddens),
        positions=ints[1],
        seq_ids=ints[4].int(),
        slot_mapping=ints[2],
        block_tables=torch.from_numpy(table.block_tables(slots)).to(head.device),
        context_lens=ints[3],
    )


def run_segments(
    head: MTPHead, kv: KVCache, table: StateTable, segments: list[Segment]
) -> torch.Tensor:
    """Computes every segment's rows in one forward; returns the output hiddens [N, H].

    The states' blocks must already cover the rows. Rows of one segment attend
    each other causally and every earlier row of their state.
    """
    return head.forward(_row_batch(head, table, segments), kv)


def draft_segments(
    head: MTPHead,
    kv: KVCache,
    table: StateTable,
    segments: list[Segment],
    bitmask: torch.Tensor | None,
    sampling: ChainSampling | None = None,
) -> tuple[torch.Tensor, Selected]:
    """Computes the segments' rows and drafts from each segment's last row (greedy, or
    as `sampling` says, each its proposal's draft 0).

    Returns (last rows' output hiddens [S, H], the drafts chosen).
    """
    out = run_segments(head, kv, table, segments)
    ends = np.cumsum([len(seg.tokens) for seg in segments]) - 1
    last = out[torch.from_numpy(ends).to(out.device)]
    if sampling is None:
        tokens, probs = head.draft(last, bitmask)
        return last, Selected(tokens, probs, None, None)
    rows, first_index = sampling.on(head.device)
    # Row r holds the token at position r + 1: the last row drafts the token after it.
    positions = torch.tensor(
        [seg.start_row + len(seg.tokens) + 1 for seg in segments], device=head.device
    )
    return last, head.select(last, bitmask, rows, positions, first_index)
