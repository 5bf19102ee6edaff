"""Which rows of a step may run: every check of a Propose, over the step's columns at once.

Each check is an array operation over the B rows, made in the order a single
Propose is checked, so a row fails with its first problem. A group fails with
the first error among its rows; then the groups that passed are given their KV
blocks in order, all or nothing per group. Nothing here changes a state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .errors import (
    DrafterError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from .state import StateTable
from .step import Step
from .validation import finite_rows


@dataclass
class Limits:
    vocab_size: int
    max_position: int  # max_position_embeddings: a row's index stays below it
    max_drafts: int
    max_rows_per_state: int | None


@dataclass
class Admitted:
    """The rows that run (indices into the step) and what each needs."""

    rows: np.ndarray  # [n] rows of the step that passed, in order
    slots: np.ndarray  # [n] their states' slots
    base_rows: np.ndarray  # [n] row index of R0 (after the verdict)
    errors: dict[int, DrafterError]  # every other row -> why


# Why no live state has an id (the engine's Ids.state_not_found): lost or never had.
NotFoundError = Callable[[int], DrafterError]


def _refused_rows(
    step: Step, slots: np.ndarray, table: StateTable, limits: Limits, not_found: NotFoundError
) -> tuple[np.ndarray, np.ndarray, Callable[[int, int], DrafterError]]:
    """(the first failed check of each row, 0 for none; base rows; the error of check c
    at row i). Rows of unknown states get check 1 and their other checks are moot."""
    b = len(step)
    known = slots >= 0
    s = np.where(known, slots, 0)  # unknown rows read slot 0, their verdict is check 1
    a = step.num_accepted
    verdict = a >= 0
    pending_row, pending_count = table.pending_row[s], table.pending_count[s]
    has_pending = pending_row >= 0
    base = np.where(verdict, pending_row + 1 + a, table.num_rows[s])
    hidden_ok = _finite(step.hiddens)
    refeed_ok = _refeed_finite(step)
    k = step.num_drafts
    confidence = step.min_confidence
    mask_empty = _empty_masks(step)
    checks = [
        ~known,
        _duplicates(step),
        table.prefilling[s],
        verdict & ~has_pending,
        ~verdict & has_pending,
        verdict & has_pending & (a > pending_count),
        ~refeed_ok,
        step.positions != base + 1,
        (step.tokens < 0) | (step.tokens >= limits.vocab_size),
        ~hidden_ok,
        (k < 1) | (k > limits.max_drafts),
        np.isnan(confidence) | (confidence < 0) | (confidence > 1),
        step.mask_counts > k,
        mask_empty,
        base + k >= limits.max_position,
        np.zeros(b, bool) if limits.max_rows_per_state is None
        else base + k > limits.max_rows_per_state,
    ]  # fmt: skip
    first = np.zeros(b, np.int64)
    for c in range(len(checks), 0, -1):  # the first failing check wins
        first[checks[c - 1]] = c

    def error(c: int, i: int) -> DrafterError:
        state = step.state_ids[i]
        match c:
            case 1:
                return not_found(int(state))
            case 2:
                in_group = i - int(np.searchsorted(step.groups, step.groups[i]))
                return InvalidArgument(
                    f"requests[{in_group}]: state {state} appears twice in one batch",
                    reason="DUPLICATE_STATE",
                    field="requests",
                )
            case 3:
                return FailedPrecondition(
                    f"cannot propose: a Prefill or ImportKV stream is open on state {state}",
                    reason="PREFILL_IN_PROGRESS",
                )
            case 4:
                return FailedPrecondition(
                    f"state {state} has no proposal awaiting a verdict",
                    reason="NO_PENDING_PROPOSAL",
                )
            case 5:
                return FailedPrecondition(
                    f"cannot propose: state {state} has a proposal awaiting its verdict "
                    "(call AfterVerify, or pass it as Propose.previous)",
                    reason="PROPOSAL_PENDING",
                )
            case 6:
                return num_accepted_out_of_range(int(a[i]), int(pending_count[i]), "previous")
            case 7:
                return not_finite("previous.refeed_hiddens")
            case 8:
                return position_mismatch(int(step.positions[i]), int(base[i]) + 1, "position")
            case 9:
                return InvalidArgument(
                    f"token: token {step.tokens[i]} is outside the vocabulary "
                    f"[0, {limits.vocab_size})",
                    reason="TOKEN_OUT_OF_RANGE",
                    field="token",
                )
            case 10:
                return not_finite("hidden")
            case 11:
                return InvalidArgument(
                    f"num_drafts: {k[i]} is outside [1, {limits.max_drafts}]",
                    reason="NUM_DRAFTS_OUT_OF_RANGE",
                    field="num_drafts",
                )
            case 12:
                return InvalidArgument(
                    f"min_confidence: {confidence[i]} is outside [0, 1]",
                    reason="MIN_CONFIDENCE_OUT_OF_RANGE",
                    field="min_confidence",
                )
            case 13:
                return InvalidArgument(
                    f"bitmask: {step.mask_counts[i]} rows for num_drafts {k[i]}: expected 1 "
                    "to num_drafts rows",
                    reason="BAD_SHAPE",
                    field="bitmask",
                )
            case 14:
                return InvalidArgument(
                    "bitmask: a row allows no token of the vocabulary",
                    reason="EMPTY_BITMASK",
                    field="bitmask",
                )
            case 15:
                return position_too_large(int(base[i] + k[i]), limits.max_position, "position")
            case _:
                return ResourceExhausted(
                    f"state {state} would hold {base[i] + k[i]} rows; the limit per state is "
                    f"{limits.max_rows_per_state}",
                    reason="ROWS_PER_STATE_EXCEEDED",
                )

    return first, base, error


def admit(
    step: Step, slots: np.ndarray, table: StateTable, limits: Limits, not_found: NotFoundError
) -> Admitted:
    """The rows of the step that run, given their states' slots (-1: no such state);
    `not_found` makes the error of a row whose state is not live."""
    first, base, error = _refused_rows(step, slots, table, limits, not_found)
    errors: dict[int, DrafterError] = {}
    failed_groups: dict[int, DrafterError] = {}
    for i in np.flatnonzero(first):
        err = error(int(first[i]), int(i))
        errors[int(i)] = err
        failed_groups.setdefault(int(step.groups[i]), err)
    ok = ~np.isin(step.groups, list(failed_groups)) if failed_groups else np.ones(len(step), bool)
    # KV blocks, group by group in order: a group that does not fit in what is left fails.
    rows = np.flatnonzero(ok)
    need = table.extra_blocks(slots[rows], base[rows] + step.num_drafts[rows])
    if need.sum() > table.pool.num_free:
        free = table.pool.num_free
        groups = step.groups[rows]
        for g in np.unique(groups):
            members = groups == g
            wanted = int(need[members].sum())
            if wanted > free:
                err = ResourceExhausted(
                    f"no free KV blocks: {wanted} needed, {free} of {table.pool.num_total} free",
                    reason="KV_BLOCKS_EXHAUSTED",
                )
                failed_groups[int(g)] = err
                for i in rows[members]:
                    errors.setdefault(int(i), err)
            else:
                free -= wanted
        ok = ~np.isin(step.groups, list(failed_groups))
        rows = np.flatnonzero(ok)
    # Every row of a failed group fails with the group's error.
    for i in np.flatnonzero(~ok):
        errors[int(i)] = failed_groups[int(step.groups[i])]
    return Admitted(rows, slots[rows], base[rows], errors)


def _duplicates(step: Step) -> np.ndarray:
    """Rows whose state came earlier in the step (each state runs once a batch)."""
    if len(set(step.state_ids.tolist())) == len(step):  # the usual case, without a sort
        return np.zeros(len(step), bool)
    _, first = np.unique(step.state_ids, return_index=True)
    repeated = np.ones(len(step), bool)
    repeated[first] = False
    return repeated


def _finite(tensor: torch.Tensor) -> np.ndarray:
    return finite_rows(tensor.reshape(tensor.shape[0], -1))


def _refeed_finite(step: Step) -> np.ndarray:
    """Per row: its refeed rows (if any) are free of NaN and inf."""
    ok = np.ones(len(step), bool)
    if step.refeed_hiddens is None:
        return ok
    rows_ok = _finite(step.refeed_hiddens)
    owner = np.repeat(np.arange(len(step)), step.refeed_counts)
    ok[owner[~rows_ok]] = False
    return ok


def _empty_masks(step: Step) -> np.ndarray:
    """Per row: one of its mask rows allows no token of the vocabulary."""
    empty = np.zeros(len(step), bool)
    if step.bitmasks is None:
        return empty
    rows_empty = (step.bitmasks == 0).all(dim=1).numpy()
    owner = np.repeat(np.arange(len(step)), step.mask_counts)
    empty[owner[rows_empty]] = True
    return empty


def not_finite(field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}: holds NaN or infinite values", reason="NOT_FINITE", field=field
    )


def position_mismatch(position: int, expected: int, field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}: position {position} does not continue the state, which expects {expected}",
        reason="POSITION_MISMATCH",
        field=field,
    )


def position_too_large(last_row: int, limit: int, field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}: row at position {last_row + 1} exceeds the model's "
        f"max_position_embeddings ({limit})",
        reason="POSITION_TOO_LARGE",
        field=field,
    )


def num_accepted_out_of_range(a: int, k: int, field: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field}.num_accepted: {a} is outside [0, {k}] (the proposal had {k} drafts)",
        reason="NUM_ACCEPTED_OUT_OF_RANGE",
        field=f"{field}.num_accepted",
    )
