"""Which rows of a step may run: every check of a Propose, over the step's columns at once.

Each check is an array operation over the B rows, made in the order a single
Propose is checked (its own values first, whatever its state, then against its
state), so a row fails with its first problem, alone; then the rows that passed
are given their KV blocks in order. Nothing here changes a state.

A numbered row (a step number above 0) that names the number and the position of
the step whose proposal is pending is that step again, a retry: it is answered
with that proposal and runs no second time. Another number not above the state's
last is stale, and refused.

The check of the hiddens (NaN/inf) may come last: `admit` leaves it out when asked,
and `Admitted.check_hiddens` makes it later, with the same outcome (a row whose first
problem comes after it and whose hidden is not finite fails with not_finite). The
engine makes it while the device drafts: a chain writes no KV for a row whose hidden
is not finite, so such a row changes nothing before it is refused.
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
    not_finite,
    num_accepted_out_of_range,
    position_mismatch,
    position_out_of_range,
    position_too_large,
)
from .sampling import first_bad, sampling_error
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
    retried: np.ndarray  # [r] rows that retry the step of their state's pending proposal
    retried_slots: np.ndarray  # [r] their states' slots
    errors: dict[int, DrafterError]  # every other row -> why
    asked: np.ndarray  # [B] the K each row of the step asks (Step.drafts_asked)
    # [B] each row's first failed check (0: none), while the hiddens' is still to make.
    unchecked: np.ndarray | None = None

    def check_hiddens(self, step: Step) -> np.ndarray:
        """Makes the check of the hiddens `admit` left out: a row whose hidden is not
        finite and that passed, or first failed a later check, fails with not_finite
        (a retry is not answered). Which of `rows` still run ([n] bool); idempotent."""
        if self.unchecked is None:
            return np.ones(len(self.rows), bool)
        first, self.unchecked = self.unchecked, None
        refused = _refused_by_hiddens(step, first)
        if not refused.any():
            return np.ones(len(self.rows), bool)
        for i in np.flatnonzero(refused).tolist():
            self.errors[i] = not_finite("hidden")
        kept = ~refused[self.retried]
        self.retried, self.retried_slots = self.retried[kept], self.retried_slots[kept]
        return ~refused[self.rows]


# Why no live state has an id (the engine's Ids.state_not_found): lost or never had.
NotFoundError = Callable[[int], DrafterError]


# The number of the hiddens' NaN/inf check in _refused_rows' order.
_HIDDENS = 6


def _refused_by_hiddens(step: Step, first: np.ndarray) -> np.ndarray:
    """Per row, given each row's first failed check but the hiddens' (0: none): the check
    of the hiddens, made in its place, refuses it (its hidden is not finite, and it
    passed or first failed a later check)."""
    return ~_finite(step.hiddens) & ((first == 0) | (first > _HIDDENS))


def _refused_rows(
    step: Step,
    k: np.ndarray,
    slots: np.ndarray,
    table: StateTable,
    limits: Limits,
    not_found: NotFoundError,
    check_hiddens: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Callable[[int, int], DrafterError]]:
    """(the first failed check of each row, 0 for none; base rows; the rows that retry
    their state's pending step; the error of check c at row i). A row's own values are
    checked first, whatever its state (INVALID_ARGUMENT for a value no state accepts),
    then against its state. Rows of unknown states fail at the first check of the state;
    its other checks are moot for them. Without `check_hiddens`, check _HIDDENS passes
    every row (Admitted.check_hiddens makes it)."""
    known = slots >= 0
    s = np.where(known, slots, 0)  # unknown rows read slot 0, their state checks are moot
    a, positions = step.num_accepted, step.positions
    auto, caps, costs = step.num_drafts == 0, step.draft_caps, step.verify_costs
    tokens, confidence, state = step.tokens, step.min_confidence, step.state_ids
    verdict = a >= 0
    pending_row, pending_count = table.pending_row[s], table.pending_count[s]
    has_pending = pending_row >= 0
    base = np.where(verdict, pending_row + 1 + a, table.num_rows[s])
    limit = limits.max_rows_per_state
    numbers, last = step.step_numbers, table.last_step[s]
    numbered = numbers > 0
    retry = (
        known & numbered & has_pending
        & (numbers == table.pending_step[s]) & (positions == pending_row + 1)
    )  # fmt: skip
    stale = numbered & ~retry & (numbers <= last)
    bad_sampling = first_bad(step.sampling)
    checks: list[tuple[np.ndarray, Callable[[int], DrafterError]]] = [
        # --- the request's own values
        (_duplicates(step), lambda i: duplicate_state(step, i)),
        (a < -1, lambda i: InvalidArgument(
            f"num_accepted: {a[i]} is neither a count of drafts nor -1 (no verdict)",
            reason="NUM_ACCEPTED_OUT_OF_RANGE",
            field="previous.num_accepted",
        )),
        (~_refeed_finite(step), lambda i: not_finite("previous.refeed_hiddens")),
        (positions < 1, lambda i: position_out_of_range(int(positions[i]), "position")),
        ((tokens < 0) | (tokens >= limits.vocab_size), lambda i: InvalidArgument(
            f"token: token {tokens[i]} is outside the vocabulary [0, {limits.vocab_size})",
            reason="TOKEN_OUT_OF_RANGE",
            field="token",
        )),
        (~_finite(step.hiddens) if check_hiddens else False, lambda i: not_finite("hidden")),
        (auto & ((caps < 0) | (caps > limits.max_drafts)), lambda i: InvalidArgument(
            f"draft_cap: {caps[i]} is outside [0, {limits.max_drafts}] (0: max_drafts)",
            reason="DRAFT_CAP_OUT_OF_RANGE",
            field="draft_cap",
        )),
        (auto & ~(np.isfinite(costs) & (costs >= 0)), lambda i: InvalidArgument(
            f"verify_token_cost: {costs[i]}; it must be finite and >= 0",
            reason="VERIFY_TOKEN_COST_OUT_OF_RANGE",
            field="verify_token_cost",
        )),
        ((k < 1) | (k > limits.max_drafts), lambda i: InvalidArgument(
            f"num_drafts: {k[i]} is outside [1, {limits.max_drafts}]",
            reason="NUM_DRAFTS_OUT_OF_RANGE",
            field="num_drafts",
        )),
        (np.isnan(confidence) | (confidence < 0) | (confidence > 1), lambda i: InvalidArgument(
            f"min_confidence: {confidence[i]} is outside [0, 1]",
            reason="MIN_CONFIDENCE_OUT_OF_RANGE",
            field="min_confidence",
        )),
        (step.mask_counts > k, lambda i: InvalidArgument(
            f"bitmask: {step.mask_counts[i]} rows for num_drafts {k[i]}: expected 1 to "
            "num_drafts rows",
            reason="BAD_SHAPE",
            field="bitmask",
        )),
        (_empty_masks(step), lambda i: InvalidArgument(
            "bitmask: a row allows no token of the vocabulary",
            reason="EMPTY_BITMASK",
            field="bitmask",
        )),
        (bad_sampling > 0, lambda i: sampling_error(
            step.sampling, i, int(bad_sampling[i]), "sampling"
        )),
        (_refused_grammars(step), lambda i: step.grammars[i].error),
        # The last draft's row, at index position - 1 + K, stays below the limit.
        (positions > limits.max_position - k, lambda i: position_too_large(
            int(positions[i] - 1 + k[i]), limits.max_position, "position"
        )),
        # --- against the state
        (~known, lambda i: not_found(int(state[i]))),
        (table.prefilling[s], lambda i: FailedPrecondition(
            f"cannot propose: a Prefill or ImportKV stream is open on state {state[i]}",
            reason="PREFILL_IN_PROGRESS",
        )),
        (stale, lambda i: FailedPrecondition(
            f"step {numbers[i]} of state {state[i]} is not after its last, {last[i]}: a "
            "step is answered again only while its proposal is pending, at its position",
            reason="STALE_STEP",
        )),
    ]  # fmt: skip
    # A retry is answered, not run: the checks of a new step that follow are not its own
    # (its verdict was applied, its position is the pending proposal's).
    retry_passes = len(checks)
    checks += [
        (verdict & ~has_pending, lambda i: FailedPrecondition(
            f"state {state[i]} has no proposal awaiting a verdict",
            reason="NO_PENDING_PROPOSAL",
        )),
        (~verdict & has_pending, lambda i: FailedPrecondition(
            f"cannot propose: state {state[i]} has a proposal awaiting its verdict "
            "(call AfterVerify, or pass it as Propose.previous)",
            reason="PROPOSAL_PENDING",
        )),
        (verdict & has_pending & (a > pending_count), lambda i: num_accepted_out_of_range(
            int(a[i]), int(pending_count[i]), "previous"
        )),
        (positions != base + 1, lambda i: position_mismatch(
            int(positions[i]), int(base[i]) + 1, "position"
        )),
        (np.zeros(len(step), bool) if limit is None else base + k > limit,
         lambda i: ResourceExhausted(
            f"state {state[i]} would hold {base[i] + k[i]} rows; the limit per state is {limit}",
            reason="ROWS_PER_STATE_EXCEEDED",
        )),
    ]  # fmt: skip
    first = np.zeros(len(step), np.int64)
    for c in range(len(checks), 0, -1):  # the first failing check wins
        first[checks[c - 1][0]] = c
    first[retry & (first > retry_passes)] = 0

    def error(c: int, i: int) -> DrafterError:
        return checks[c - 1][1](i)

    return first, base, retry, error


def admit(
    step: Step,
    slots: np.ndarray,
    table: StateTable,
    limits: Limits,
    not_found: NotFoundError,
    *,
    check_hiddens: bool = True,
) -> Admitted:
    """The rows of the step that run, given their states' slots (-1: no such state);
    `not_found` makes the error of a row whose state is not live. Without
    `check_hiddens`, the hiddens' NaN/inf check is left to Admitted.check_hiddens, unless
    the KV blocks run short (rows take them in order: a refused row takes none)."""
    k = step.drafts_asked(limits.max_drafts)
    if not check_hiddens and (usual := _usual(step, k, slots, table, limits)) is not None:
        rows = np.arange(len(step))
        none = rows[:0]
        return Admitted(rows, slots, usual, none, none, {}, k, np.zeros(len(step), np.int64))
    first, base, retry, error = _refused_rows(
        step, k, slots, table, limits, not_found, check_hiddens
    )
    rows = np.flatnonzero((first == 0) & ~retry)
    need = table.extra_blocks(slots[rows], base[rows] + k[rows])
    short = need.sum() > table.pool.num_free
    if short and not check_hiddens:  # rows take blocks in order: a refused row takes none
        first = np.where(_refused_by_hiddens(step, first), _HIDDENS, first)
        rows = np.flatnonzero((first == 0) & ~retry)
        need = table.extra_blocks(slots[rows], base[rows] + k[rows])
    errors = {int(i): error(int(first[i]), int(i)) for i in np.flatnonzero(first)}
    retried = np.flatnonzero((first == 0) & retry)
    if short:
        # KV blocks row by row in order: a row that does not fit in what is left fails.
        free, fits = table.pool.num_free, np.ones(len(rows), bool)
        for j, wanted in enumerate(need.tolist()):
            if wanted > free:
                fits[j] = False
                errors[int(rows[j])] = ResourceExhausted(
                    f"no free KV blocks: {wanted} needed, {free} of {table.pool.num_total} free",
                    reason="KV_BLOCKS_EXHAUSTED",
                )
            else:
                free -= wanted
        rows = rows[fits]
    unchecked = None if check_hiddens or short else first
    return Admitted(rows, slots[rows], base[rows], retried, slots[retried], errors, k, unchecked)


def _usual(
    step: Step, k: np.ndarray, slots: np.ndarray, table: StateTable, limits: Limits
) -> np.ndarray | None:
    """The usual step's base rows, decided in a few operations: every row passes every
    check but the hiddens' and is no retry, and the pool holds the blocks they need.
    None for any other step, which _refused_rows checks row by row (its refeeds, masks,
    grammar or sampling changes and drafts chosen by count are never the usual)."""
    if (
        step.refeed_hiddens is not None
        or step.bitmasks is not None
        or step.changes_grammars
        or step.sampling["set"].any()
        or (slots < 0).any()
        or len(set(slots.tolist())) != len(slots)
    ):
        return None
    a, positions, numbers = step.num_accepted, step.positions, step.step_numbers
    pending_row = table.pending_row[slots]
    verdict = a >= 0
    base = np.where(verdict, pending_row + 1 + a, table.num_rows[slots])
    confidence, tokens = step.min_confidence, step.tokens
    ok = (
        (verdict == (pending_row >= 0))
        & (a >= -1)
        & (a <= table.pending_count[slots])
        & (positions == base + 1)
        & (positions <= limits.max_position - k)
        & (tokens >= 0) & (tokens < limits.vocab_size)
        & (step.num_drafts >= 1) & (k <= limits.max_drafts)
        & (confidence >= 0) & (confidence <= 1)
        & ((numbers == 0) | (numbers > table.last_step[slots]))
        & ~table.prefilling[slots]
    )  # fmt: skip
    if limits.max_rows_per_state is not None:
        ok &= base + k <= limits.max_rows_per_state
    if not ok.all() or table.extra_blocks(slots, base + k).sum() > table.pool.num_free:
        return None
    return base


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


def _refused_grammars(step: Step) -> np.ndarray:
    """Per row: the grammar it gives did not compile (the change keeps why)."""
    if not step.changes_grammars:
        return np.zeros(len(step), bool)
    return np.fromiter(
        (c is not None and c.error is not None for c in step.grammars), bool, len(step)
    )


def _empty_masks(step: Step) -> np.ndarray:
    """Per row: one of its mask rows allows no token of the vocabulary."""
    empty = np.zeros(len(step), bool)
    if step.bitmasks is None:
        return empty
    rows_empty = (step.bitmasks == 0).all(dim=1).numpy()
    owner = np.repeat(np.arange(len(step)), step.mask_counts)
    empty[owner[rows_empty]] = True
    return empty


def duplicate_state(step: Step, i: int) -> InvalidArgument:
    """Row i's state came earlier in its batch."""
    return InvalidArgument(
        f"state_id: state {step.state_ids[i]} appears twice in one batch",
        reason="DUPLICATE_STATE",
        field="state_id",
    )
