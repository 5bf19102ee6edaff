"""A verifier's step for many states as the wire gives it (a ProposeBatch message's
columns): checked as a whole, then a Step.

The columns must fit together (lengths, tensor shapes, row counts) or the whole
step is refused with INVALID_ARGUMENT; each row is then one state's Propose
(with its fused verdict), which the engine answers or fails on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..grammar.spec import GrammarChange
from . import sampling as draws
from .errors import InvalidArgument
from .step import Step, StepShape, grammar_column, padded_mask
from .step import refeed_rows as checked_refeeds  # `refeed_rows` names a column here
from .validation import as_rows


def _mismatch(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {message}", reason="COLUMNS_MISMATCH", field=field)


def _column(values: Sequence, field: str, size: int, dtype, *, default=None) -> np.ndarray:
    """B values; one value stands for all where a default is given, none for the default."""
    array = np.asarray(values, dtype)
    if default is not None and len(array) in (0, 1):
        return np.full(size, array[0] if len(array) else default, dtype)
    if len(array) != size:
        raise _mismatch(field, f"{len(array)} values for {size} states")
    return array


def _counts(values: Sequence[int], field: str, size: int) -> np.ndarray:
    counts = np.zeros(size, np.int64) if not len(values) else _column(values, field, size, np.int64)
    if (counts < 0).any():
        raise _mismatch(field, "a negative row count")
    return counts


def _row_count(tensor: torch.Tensor | None) -> int:
    """The rows of a ragged column's tensor: [n, X], or one row flat, [X] (-1: neither)."""
    if tensor is None:
        return 0
    if tensor.dim() == 1:
        return int(tensor.numel() > 0)
    return tensor.shape[0] if tensor.dim() else -1


def _ragged(tensor: torch.Tensor | None, counts: np.ndarray, field: str) -> torch.Tensor | None:
    total = int(counts.sum())
    rows = _row_count(tensor)
    if rows != total:
        raise _mismatch(field, f"{rows} rows where the counts add up to {total}")
    return tensor if total else None


def step(
    shape: StepShape,
    *,
    state_ids: Sequence[int],
    tokens: Sequence[int],
    positions: Sequence[int],
    hiddens: torch.Tensor,
    num_drafts: Sequence[int],
    num_accepted: Sequence[int] = (),
    refeed_rows: Sequence[int] = (),
    refeed_hiddens: torch.Tensor | None = None,
    bitmask_rows: Sequence[int] = (),
    bitmasks: torch.Tensor | None = None,
    min_confidence: Sequence[float] = (),
    step_numbers: Sequence[int] = (),
    sampling_rows: Sequence[int] = (),
    sampling: Sequence[draws.Sampling] = (),
    draft_caps: Sequence[int] = (),
    verify_token_costs: Sequence[float] = (),
    grammar_rows: Sequence[int] = (),
    grammars: Sequence[GrammarChange] = (),
) -> Step:
    """B states' columns (see ProposeBatchRequest) as a Step, or INVALID_ARGUMENT when
    they do not fit together: `hiddens` [B, H] ([H] for B = 1); `num_drafts` and
    `min_confidence` and `step_numbers` B values or one for all; `num_accepted` B values
    (-1: no verdict);
    `refeed_rows` and `bitmask_rows` a row count per state of `refeed_hiddens`
    ([sum, H]) and `bitmasks` ([sum, W] int32); `sampling_rows` the rows (ascending)
    whose states take the parameters `sampling` (one per row listed); `draft_caps` and
    `verify_token_costs` B values or one for all, for the rows with num_drafts 0;
    `grammar_rows` the rows (ascending) whose states take the grammar changes `grammars`
    (one per row listed). An empty column is its default."""
    size = len(state_ids)
    if not 1 <= size <= shape.max_batch:
        raise InvalidArgument(
            f"state_ids: {size} states, expected 1 to {shape.max_batch}",
            reason="BATCH_SIZE_OUT_OF_RANGE",
            field="state_ids",
        )
    if not len(num_drafts):
        raise _mismatch("num_drafts", "required: one value for every state, or one for all")
    hiddens = as_rows(hiddens, size, shape.hidden_size, "hiddens")
    accepted = np.full(size, -1, np.int64)
    if len(num_accepted):
        accepted = _column(num_accepted, "num_accepted", size, np.int64)
    refeed_counts = _counts(refeed_rows, "refeed_rows", size)
    wrong = np.flatnonzero((refeed_counts != 0) & (refeed_counts != accepted))
    if len(wrong):
        i = int(wrong[0])
        raise _mismatch(
            "refeed_rows",
            f"state {i} has {refeed_counts[i]} refeed rows for {accepted[i]} accepted",
        )
    refeeds = _ragged(refeed_hiddens, refeed_counts, "refeed_hiddens")
    if refeeds is not None:
        refeeds = checked_refeeds(
            refeeds, int(refeed_counts.sum()), shape.hidden_size, "refeed_hiddens"
        )
    mask_counts = _counts(bitmask_rows, "bitmask_rows", size)
    masks = _ragged(bitmasks, mask_counts, "bitmasks")
    if masks is not None:
        masks = padded_mask(masks, shape.vocab_size, "bitmasks")
    return Step(
        sampling=draws.changes(_per_row(sampling_rows, sampling, size, "sampling")),
        grammars=grammar_column(_per_row(grammar_rows, grammars, size, "grammar")),
        draft_caps=_column(draft_caps, "draft_caps", size, np.int64, default=0),
        verify_costs=_column(
            verify_token_costs, "verify_token_costs", size, np.float64, default=0.0
        ),
        state_ids=_column(state_ids, "state_ids", size, np.uint64),
        tokens=_column(tokens, "tokens", size, np.int64),
        positions=_column(positions, "positions", size, np.int64),
        hiddens=hiddens,
        num_drafts=_column(num_drafts, "num_drafts", size, np.int64, default=0),
        num_accepted=accepted,
        refeed_counts=refeed_counts,
        refeed_hiddens=refeeds,
        mask_counts=mask_counts,
        bitmasks=masks,
        min_confidence=_column(min_confidence, "min_confidence", size, np.float64, default=0.0),
        step_numbers=_column(step_numbers, "step_numbers", size, np.uint64, default=0),
    )


def _per_row(rows: Sequence[int], values: Sequence, size: int, name: str) -> list:
    """A column of changes given for some rows: `values[j]` at row `rows[j]`, None at the
    others (`name`: the wire's columns, `{name}_rows` and their values)."""
    if not len(rows) and not len(values):  # the usual step: no row changes
        return [None] * size
    if len(rows) != len(values):
        raise _mismatch(f"{name}_rows", f"{len(rows)} rows for {len(values)} {name} values")
    rows = np.asarray(rows, np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= size or (np.diff(rows) <= 0).any()):
        raise _mismatch(f"{name}_rows", f"rows must ascend, each once, in [0, {size})")
    per_row: list = [None] * size
    for row, value in zip(rows.tolist(), values, strict=True):
        per_row[row] = value
    return per_row
