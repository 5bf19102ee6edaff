"""A propose step of many states as columns (`Step`), and its answer (`StepResult`).

Every Propose the engine serves travels as a Step: the converter makes each propose
message one (a ProposeBatch message with `columns.step`, a Propose with `single`), and
the scheduler joins the calls of one batch into one (`concat`). Row i of every column
is one state's request, and each row stands or fails alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from ..grammar.spec import GrammarChange
from . import sampling as draws
from .errors import DrafterError, InvalidArgument, num_accepted_negative
from .types import Proposal, Verdict
from .validation import as_rows, check_floating


@dataclass(frozen=True)
class StepShape:
    """What a request is checked against before it is a Step: the model's hidden size,
    its vocabulary (the bitmasks' width) and the most rows a step may hold."""

    hidden_size: int
    vocab_size: int
    max_batch: int


@dataclass
class Step:
    """B states' requests, row by row; hiddens stay on the host until the chain's copy."""

    state_ids: np.ndarray  # [B] uint64
    tokens: np.ndarray  # [B] int64
    positions: np.ndarray  # [B] int64: the token's position, 1 + rows the state holds
    hiddens: torch.Tensor  # [B, H] float: target hidden at position - 1
    num_drafts: np.ndarray  # [B] int64
    num_accepted: np.ndarray  # [B] int64: the fused verdict on the pending proposal, -1: none
    refeed_counts: np.ndarray  # [B] int64: 0, or num_accepted rows of refeed_hiddens
    refeed_hiddens: torch.Tensor | None  # [sum(refeed_counts), H]
    mask_counts: np.ndarray  # [B] int64: rows of bitmasks (0: no mask)
    bitmasks: torch.Tensor | None  # [sum(mask_counts), ceil(V / 32)] int32
    min_confidence: np.ndarray  # [B] float64
    # [B] uint64: the verifier's number of the state's step (0: none), which makes a
    # retry of the step answer as the step did (admission.py)
    step_numbers: np.ndarray
    sampling: np.ndarray  # [B] sampling.CHANGES: new sampling parameters (`set`), if any
    # Where num_drafts is 0 (the drafter chooses K, draft_count.py): the most drafts it
    # may choose (0: max_drafts), and the cost of verifying one more token.
    draft_caps: np.ndarray  # [B] int64
    verify_costs: np.ndarray  # [B] float64
    # [B] object: the row's GrammarChange (its state's grammar from this step's token on),
    # None where it keeps its grammar
    grammars: np.ndarray

    def __len__(self) -> int:
        return len(self.state_ids)

    @functools.cached_property
    def changes_grammars(self) -> bool:
        """Whether some row gives its state a grammar, or takes it away."""
        return self.grammars.tolist().count(None) != len(self.grammars)

    def drafts_asked(self, max_drafts: int) -> np.ndarray:
        """[B] K of each row: its num_drafts, or where that is 0, its cap (0: max_drafts)."""
        cap = np.where(self.draft_caps == 0, max_drafts, self.draft_caps)
        return np.where(self.num_drafts == 0, cap, self.num_drafts)

    @staticmethod
    def concat(steps: list[Step]) -> Step:
        """One step of many, their rows in order."""
        if len(steps) == 1:
            return steps[0]
        columns = {}
        for f in fields(Step):
            parts = [getattr(s, f.name) for s in steps]
            if isinstance(parts[0], np.ndarray):
                columns[f.name] = np.concatenate(parts)
            else:
                columns[f.name] = _cat([p for p in parts if p is not None])
        return Step(**columns)


def single(
    state_id: int,
    token: int,
    hidden: torch.Tensor,
    position: int,
    num_drafts: int,
    bitmask: torch.Tensor | None = None,
    min_confidence: float = 0.0,
    previous: Verdict | None = None,
    step_number: int = 0,
    sampling: draws.Sampling | None = None,
    draft_cap: int = 0,
    verify_token_cost: float = 0.0,
    grammar: GrammarChange | None = None,
    *,
    shape: StepShape,
) -> Step:
    """One state's Propose as a Step of one row: `hidden` [H] or [1, H], `bitmask` int32
    [W] or [n, W] (xgrammar's layout), `previous` the verdict on its pending proposal,
    `step_number` the step's number (0: none), `sampling` the state's sampling from this
    step on (None: unchanged); with num_drafts 0, `draft_cap` and `verify_token_cost` as a
    ProposeRequest's; `grammar` the state's grammar from this step's token on (None:
    unchanged).

    Raises InvalidArgument for a tensor of the wrong shape or dtype, naming the
    Propose's field, as the request cannot be a row then.
    """
    row = as_rows(hidden, 1, shape.hidden_size, "hidden")
    check_floating(row, "hidden")
    accepted, refeed = -1, None
    if previous is not None:
        accepted = previous.num_accepted
        refeed = verdict_refeed(previous, shape.hidden_size, "previous")
    mask = None if bitmask is None else padded_mask(bitmask, shape.vocab_size, "bitmask")
    return Step(
        state_ids=np.array([state_id], np.uint64),
        tokens=np.array([token], np.int64),
        positions=np.array([position], np.int64),
        hiddens=row,
        num_drafts=np.array([num_drafts], np.int64),
        num_accepted=np.array([accepted], np.int64),
        refeed_counts=np.array([0 if refeed is None else accepted], np.int64),
        refeed_hiddens=refeed,
        mask_counts=np.array([0 if mask is None else mask.shape[0]], np.int64),
        bitmasks=mask,
        min_confidence=np.array([min_confidence], np.float64),
        step_numbers=np.array([step_number], np.uint64),
        sampling=draws.changes([sampling]),
        draft_caps=np.array([draft_cap], np.int64),
        verify_costs=np.array([verify_token_cost], np.float64),
        grammars=grammar_column([grammar]),
    )


def grammar_column(changes: list[GrammarChange | None]) -> np.ndarray:
    """A step's grammars column: [B] object, a GrammarChange or None per row."""
    column = np.empty(len(changes), object)
    column[:] = changes
    return column


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor of rows; rows of different float dtypes meet in fp32 (exact for all)."""
    if not tensors:
        return None
    if len(tensors) == 1:
        return tensors[0]
    if len({t.dtype for t in tensors}) > 1:
        tensors = [t.float() for t in tensors]
    return torch.cat(tensors)


def verdict_refeed(verdict: Verdict, hidden_size: int, field: str) -> torch.Tensor | None:
    """A verdict's refeed hiddens as [num_accepted, H], or None for no refeed; its count
    and shape checked (INVALID_ARGUMENT), whatever the state it is for."""
    a, refeed = verdict.num_accepted, verdict.refeed_hiddens
    if a < 0:
        raise num_accepted_negative(a, field)
    if refeed is None or (refeed.numel() == 0 and a == 0):
        return None
    return refeed_rows(refeed, a, hidden_size, f"{field}.refeed_hiddens")


def refeed_rows(refeed: torch.Tensor, rows: int, hidden_size: int, field: str) -> torch.Tensor:
    """A verdict's refeed hiddens as [rows, H] (see validation.as_rows)."""
    refeed = as_rows(refeed, rows, hidden_size, field)
    check_floating(refeed, field)
    return refeed


def padded_mask(bitmask: torch.Tensor, vocab_size: int, field: str) -> torch.Tensor:
    """A bitmask ([W] or [n, W] int32, W <= ceil(V / 32)) as [n, ceil(V / 32)], padded
    with zero words and its bits past the vocabulary cleared: no token past the mask,
    nor past the vocabulary, is allowed."""
    words = (vocab_size + 31) // 32
    if bitmask.dtype != torch.int32:
        raise InvalidArgument(
            f"{field}: expected int32, got {bitmask.dtype}", reason="BAD_DTYPE", field=field
        )
    mask = bitmask.reshape(1, -1) if bitmask.dim() == 1 else bitmask  # one row, flat
    if mask.dim() != 2 or mask.shape[0] < 1 or not 1 <= mask.shape[1] <= words:
        raise InvalidArgument(
            f"{field}: expected shape [words] or [n, words] with 1 <= n <= num_drafts and "
            f"1 <= words <= {words}, got {list(bitmask.shape)}",
            reason="BAD_SHAPE",
            field=field,
        )
    if mask.shape[1] < words:
        mask = torch.nn.functional.pad(mask, (0, words - mask.shape[1]))
    tail_bits = vocab_size - 32 * (words - 1)  # bits of the last word that name tokens
    if tail_bits < 32 and mask.shape[1] == words:
        mask = mask.clone()
        mask[:, -1] &= (1 << tail_bits) - 1
    return mask


@dataclass
class StepResult:
    """A step's answer as columns: row i answers the step's row i."""

    drafts: np.ndarray  # [B, width] int64, -1 past a row's count
    probs: np.ndarray  # [B, width] float32, 0 past a row's count
    counts: np.ndarray  # [B] int64: drafts of each row (0 for a failed row)
    confidences: np.ndarray  # [B] float64: the chain confidence (0 for a failed row)
    first_positions: np.ndarray  # [B] int64 (0 for a failed row)
    errors: dict[int, DrafterError]  # row -> why it failed; its state is unchanged
    # Each draft's q as its support (sampled drafts; a greedy row's: its draft alone),
    # [B, width, support], probability 0 past a row's q and count; support 0: none sampled.
    q_ids: np.ndarray | None = None  # int64
    q_probs: np.ndarray | None = None  # float32
    # row -> its grammar's bitmasks, [count + 1, W] int32 (rows of states with a grammar)
    grammar_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def rows(self, lo: int, hi: int) -> StepResult:
        """Rows lo .. hi - 1 (a view), their errors and grammar masks renumbered from 0."""
        return StepResult(
            self.drafts[lo:hi],
            self.probs[lo:hi],
            self.counts[lo:hi],
            self.confidences[lo:hi],
            self.first_positions[lo:hi],
            {row - lo: err for row, err in self.errors.items() if lo <= row < hi},
            None if self.q_ids is None else self.q_ids[lo:hi],
            None if self.q_probs is None else self.q_probs[lo:hi],
            {row - lo: m for row, m in self.grammar_masks.items() if lo <= row < hi},
        )

    def proposal(self, row: int, state_id: int) -> Proposal:
        n = int(self.counts[row])
        return Proposal(
            state_id=state_id,
            tokens=self.drafts[row, :n].tolist(),
            probs=self.probs[row, :n].tolist(),
            confidence=float(self.confidences[row]),
            first_position=int(self.first_positions[row]),
            q_ids=None if self.q_ids is None else self.q_ids[row, :n].tolist(),
            q_probs=None if self.q_probs is None else self.q_probs[row, :n].tolist(),
        )
