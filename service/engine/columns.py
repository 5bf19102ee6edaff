"""A verifier's step for many states as columns: checked as a whole, then row by row.

The columns must fit together (lengths, tensor shapes) or the whole step is
refused; each row is then one state's Propose (with its fused verdict), which
fails on its own. Rows become the engine's per-state requests here, views into
the step's tensors (no copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidArgument
from .types import ProposeArgs, Verdict
from .validation import check_batch_size


@dataclass
class Columns:
    """B states' step (row i of every column is state_ids[i]'s); see ColumnsRequest."""

    state_ids: list[int]
    tokens: list[int]
    positions: list[int]
    hiddens: torch.Tensor  # [B, H]
    num_drafts: list[int]  # B values, or one for all
    num_accepted: list[int]  # B values (-1: no verdict), or empty
    refeed_rows: list[int]  # B values, or empty
    refeed_hiddens: torch.Tensor | None  # [sum(refeed_rows), H]
    bitmask_rows: list[int]  # B values, or empty
    bitmasks: torch.Tensor | None  # [sum(bitmask_rows), W] int32
    min_confidence: list[float]  # B values, one for all, or empty


def _mismatch(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {message}", reason="COLUMNS_MISMATCH", field=field)


def _per_row(values: list, field: str, size: int, *, one_for_all: bool) -> None:
    allowed = (0, size, 1) if one_for_all else (0, size)
    if len(values) not in allowed:
        raise _mismatch(field, f"{len(values)} values for {size} states")


def _split(tensor: torch.Tensor | None, counts: list[int], field: str, counts_field: str) -> list:
    """The rows of `tensor` that each state's count takes, in order (None for 0)."""
    if any(c < 0 for c in counts):
        raise _mismatch(counts_field, "a negative row count")
    total = sum(counts)
    rows = 0 if tensor is None else (tensor.shape[0] if tensor.dim() else -1)
    if rows != total:
        raise _mismatch(field, f"{rows} rows where the counts add up to {total}")
    if not total:
        return [None] * len(counts)
    parts = torch.split(tensor, counts)
    return [part if count else None for part, count in zip(parts, counts, strict=True)]


def rows(columns: Columns, hidden_size: int, max_batch: int) -> list[ProposeArgs]:
    """Each state's request, or INVALID_ARGUMENT when the columns do not fit together."""
    c = columns
    size = len(c.state_ids)
    check_batch_size(size, max_batch)
    for values, field in ((c.tokens, "tokens"), (c.positions, "positions")):
        if len(values) != size:
            raise _mismatch(field, f"{len(values)} values for {size} states")
    _per_row(c.num_drafts, "num_drafts", size, one_for_all=True)
    if not c.num_drafts:
        raise _mismatch("num_drafts", "required: one value for every state, or one for all")
    _per_row(c.min_confidence, "min_confidence", size, one_for_all=True)
    for values, field in (
        (c.num_accepted, "num_accepted"),
        (c.refeed_rows, "refeed_rows"),
        (c.bitmask_rows, "bitmask_rows"),
    ):
        _per_row(values, field, size, one_for_all=False)
    if tuple(c.hiddens.shape) != (size, hidden_size):
        raise InvalidArgument(
            f"hiddens: expected shape [{size}, {hidden_size}], got {list(c.hiddens.shape)}",
            reason="BAD_SHAPE",
            field="hiddens",
        )
    refeed_counts = c.refeed_rows or [0] * size
    accepted = c.num_accepted or [-1] * size
    for i, (count, a) in enumerate(zip(refeed_counts, accepted, strict=True)):
        if count and count != a:
            raise _mismatch("refeed_rows", f"state {i} has {count} refeed rows for {a} accepted")
    refeeds = _split(c.refeed_hiddens, refeed_counts, "refeed_hiddens", "refeed_rows")
    masks = _split(c.bitmasks, c.bitmask_rows or [0] * size, "bitmasks", "bitmask_rows")
    num_drafts = c.num_drafts * size if len(c.num_drafts) == 1 else c.num_drafts
    confidences = c.min_confidence or [0.0]
    confidences = confidences * size if len(confidences) == 1 else confidences
    return [
        ProposeArgs(
            state_id=c.state_ids[i],
            token=c.tokens[i],
            hidden=hidden,
            position=c.positions[i],
            num_drafts=num_drafts[i],
            bitmask=masks[i],
            min_confidence=confidences[i],
            previous=None if accepted[i] < 0 else Verdict(accepted[i], refeeds[i]),
        )
        for i, hidden in enumerate(c.hiddens.unbind(0))
    ]
