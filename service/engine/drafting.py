"""The drafting itself: n states' chains of drafts, computed as columns.

It is handed the rows to advance (their states already hold the KV blocks the
rows need) and knows nothing of leases, limits or how the rows were chosen. A
state whose verdict recomputes rows (refeed hiddens, or the row of an accepted
last draft) takes its first draft from one forward over those rows and R0; every
state then continues in one device-side chain of one-row decode steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..model.decode_chain import BeforeWait, ChainInputs, ChainSampling
from ..model.kv_cache import KVCache
from ..model.mtp_head import MTPHead
from . import draft_count
from .rows import Segment, draft_segments
from .sampling import chain_sampling
from .state import StateTable


@dataclass
class ChainPlan:
    """n states to draft for: row i is state slots[i]'s."""

    slots: np.ndarray  # [n]
    tokens: np.ndarray  # [n] int64: R0's token
    hiddens: torch.Tensor  # [n, H] on the host: R0's hidden
    base_rows: np.ndarray  # [n] row index of R0
    num_drafts: np.ndarray  # [n] K
    min_confidence: np.ndarray  # [n]
    mask_starts: np.ndarray  # [n] first row of bitmasks that is this state's (if any)
    mask_counts: np.ndarray  # [n] 0: no mask
    bitmasks: torch.Tensor | None  # [rows, W] int32
    recompute: list[tuple[int, Segment]]  # (i, the rows its verdict recomputes before R0)
    sampling: np.ndarray  # [n] sampling.PARAMS: how each state's drafts are chosen
    state_ids: np.ndarray  # [n] uint64: a sampled draw's key word
    support: int  # the most tokens a sampled draft's q holds
    verify_costs: np.ndarray  # [n] where the drafter chooses K (draft_count.py); else NaN
    calibration: np.ndarray  # [n] each state's (draft_count.py)

    @property
    def samples(self) -> bool:
        """Whether some state of the plan draws its drafts (temperature > 0)."""
        return bool((self.sampling["temperature"] > 0).any())

    def chain_sampling(self, rows: np.ndarray, first_index: np.ndarray) -> ChainSampling | None:
        """The sampling of the plan's `rows`, their chains' first draft index given."""
        return chain_sampling(self.sampling[rows], self.state_ids[rows], first_index, self.support)


@dataclass
class Drafted:
    """Each state's drafts after min_confidence, as columns."""

    drafts: np.ndarray  # [n, width] int64, -1 past count
    probs: np.ndarray  # [n, width] float32, 0 past count
    counts: np.ndarray  # [n]
    confidences: np.ndarray  # [n]
    rows_computed: np.ndarray  # [n] rows R0 .. written to the KV
    all_drafts: np.ndarray  # [n, width] every draft computed, kept or not
    # Sampled plans: each kept draft's q, [n, width, support] (0 past q and past count).
    q_ids: np.ndarray | None = None
    q_probs: np.ndarray | None = None

    def rows(self, kept: np.ndarray) -> Drafted:
        """The states `kept` ([n] bool) selects."""
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Drafted(*(None if v is None else v[kept] for v in values))


def _mask_rows(plan: ChainPlan, rows: np.ndarray, drafts_before: np.ndarray, steps: int):
    """[steps, len(rows)] index into [bitmasks; all-ones row] of each step's mask (a mask
    of fewer rows than drafts repeats its last row)."""
    step = np.arange(steps)[:, None]
    counts, starts = plan.mask_counts[rows], plan.mask_starts[rows]
    own = starts + np.minimum(drafts_before + step, np.maximum(counts, 1) - 1)
    return np.where(counts > 0, own, plan.bitmasks.shape[0])


def _masks(plan: ChainPlan, index: np.ndarray) -> torch.Tensor:
    ones = plan.bitmasks.new_full((1, plan.bitmasks.shape[1]), -1)
    return torch.cat([plan.bitmasks, ones])[torch.from_numpy(index)]


def draft(
    head: MTPHead,
    kv: KVCache,
    table: StateTable,
    plan: ChainPlan,
    before_wait: BeforeWait | None = None,
) -> tuple[Drafted, torch.Tensor]:
    """The drafts of every state, and the output hidden of each one's last computed row
    ([n, H] on the device). `before_wait` runs while the device computes the chain, if one
    runs (decode_chain.BeforeWait; its hiddens are the chained rows', in plan order)."""
    n, k = len(plan.slots), plan.num_drafts
    width = int(k.max())
    tokens = np.full((n, width), -1, np.int64)
    probs = np.zeros((n, width), np.float32)
    q = None  # each draft's q (ids, probabilities), when some state samples
    if plan.samples:
        support = min(plan.support, head.config.vocab_size)
        q = (np.zeros((n, width, support), np.int64), np.zeros((n, width, support), np.float32))
    offsets = np.zeros(n, np.int64)  # drafts taken before the chain: 1 if recomputed
    first = None
    if plan.recompute:
        first = _first_drafts(head, kv, table, plan)
        tokens[first.rows, 0], probs[first.rows, 0] = first.drafts, first.probs
        if q is not None and first.q_ids is not None:
            q[0][first.rows, 0], q[1][first.rows, 0] = first.q_ids, first.q_probs
        offsets[first.rows] = 1
    limits = k - offsets
    chained = np.flatnonzero(limits > 0)
    out = None
    if len(chained):
        out = _chain(head, kv, table, plan, chained, offsets, limits, first, before_wait)
        if first is None and (k == width).all():  # every state took every step: a transpose
            tokens[:], probs[:] = out.tokens.T, out.probs.T
            if q is not None and out.q_ids is not None:
                q[0][:], q[1][:] = out.q_ids.transpose(1, 0, 2), out.q_probs.transpose(1, 0, 2)
        else:
            step, column = np.nonzero(np.arange(out.tokens.shape[0])[:, None] < limits[chained])
            rows = chained[column]
            tokens[rows, offsets[rows] + step] = out.tokens[step, column]
            probs[rows, offsets[rows] + step] = out.probs[step, column]
            if q is not None and out.q_ids is not None:
                q[0][rows, offsets[rows] + step] = out.q_ids[step, column]
                q[1][rows, offsets[rows] + step] = out.q_probs[step, column]
    at_most = k.copy()  # drafts each state keeps, at most
    chooses = np.flatnonzero(~np.isnan(plan.verify_costs))
    if len(chooses):
        at_most[chooses] = draft_count.counts(
            probs[chooses], k[chooses], plan.calibration[chooses], plan.verify_costs[chooses]
        )
    drafted = _confident(tokens, probs, k, plan.min_confidence, at_most)
    if q is not None:
        # A greedy row's q is its draft alone, whichever path (the recomputed first draft,
        # the chain) it took with or without sampled rows beside it.
        greedy = plan.sampling["temperature"] <= 0
        draft_alone(*q, greedy, tokens[greedy], True)
        drafted.q_ids, drafted.q_probs = _kept_q(q, drafted.counts)
    # Each state's last computed row: a step of the chain, or R0 of a recomputing state
    # that stopped at its first draft.
    last = drafted.rows_computed - 1
    in_chain = np.flatnonzero(last >= offsets)
    steps = last[in_chain] - offsets[in_chain]
    if len(chained) == len(in_chain) == n and (steps == steps[0]).all():
        return drafted, out.hiddens[int(steps[0])]  # every state stopped at one step: a view
    hiddens = torch.empty(n, head.config.hidden_size, dtype=head.dtype, device=head.device)
    if len(in_chain):
        column = torch.from_numpy(np.searchsorted(chained, in_chain))
        picked = out.hiddens[torch.from_numpy(steps), column]
        if len(in_chain) == n:
            return drafted, picked
        hiddens[torch.from_numpy(in_chain)] = picked
    at_r0 = np.flatnonzero(last < offsets)
    if len(at_r0):
        hiddens[torch.from_numpy(at_r0)] = first.hiddens[np.searchsorted(first.rows, at_r0)]
    return drafted, hiddens


@dataclass
class _FirstDrafts:
    rows: np.ndarray  # [r] the plan's rows that recompute, ascending
    hiddens: torch.Tensor  # [r, H] on the device: R0's output
    drafts: np.ndarray  # [r]
    probs: np.ndarray  # [r]
    q_ids: np.ndarray | None = None  # [r, support]: sampled plans only
    q_probs: np.ndarray | None = None


def _first_drafts(head, kv, table, plan: ChainPlan) -> _FirstDrafts:
    """One forward: each recomputing state's verdict rows followed by its R0."""
    rows = np.array([i for i, _ in plan.recompute], np.int64)
    r0 = plan.hiddens[torch.from_numpy(rows)].to(head.device, head.dtype)
    segments = []
    for j, (i, recomputed) in enumerate(plan.recompute):
        hiddens = torch.cat([recomputed.hiddens.to(head.device, head.dtype), r0[j : j + 1]])
        tokens = np.append(recomputed.tokens, plan.tokens[i])
        segments.append(Segment(int(plan.slots[i]), recomputed.start_row, tokens, hiddens))
    bitmask = None
    if plan.bitmasks is not None:
        index = _mask_rows(plan, rows, np.zeros(len(rows), np.int64), 1)[0]
        bitmask = _masks(plan, index).to(head.device)
    sampling = plan.chain_sampling(rows, np.zeros(len(rows), np.int64))
    hidden, chosen = draft_segments(head, kv, table, segments, bitmask, sampling)
    q = (None, None) if sampling is None else (chosen.q_ids, chosen.q_probs)
    return _FirstDrafts(
        rows,
        hidden,
        chosen.tokens.cpu().numpy(),
        chosen.probs.float().cpu().numpy(),
        *(None if t is None else t.cpu().numpy() for t in q),
    )


def _chain(head, kv, table, plan: ChainPlan, chained, offsets, limits, first, before_wait):
    """The chain of decode steps of the rows `chained`: fresh ones start at R0,
    recomputing ones after their first draft (its token, R0's output hidden)."""
    whole = len(chained) == len(plan.slots)
    hiddens = plan.hiddens if whole else plan.hiddens[torch.from_numpy(chained)]
    tokens = plan.tokens[chained]
    if first is not None:
        going = limits[first.rows] > 0
        at = np.searchsorted(chained, first.rows[going])
        # A copy: the rows written next must not land in the caller's tensor.
        hiddens = hiddens.to(head.device, head.dtype, copy=True)
        hiddens[torch.from_numpy(at)] = first.hiddens[torch.from_numpy(going)]
        tokens = tokens.copy()
        tokens[at] = first.drafts[going]
    steps = int(limits[chained].max())
    masks = None
    if plan.bitmasks is not None:
        masks = _masks(plan, _mask_rows(plan, chained, offsets[chained], steps))
    return head.decode_chain(
        kv,
        ChainInputs(
            tokens=tokens,
            hiddens=hiddens,
            positions=plan.base_rows[chained] + offsets[chained],
            limits=limits[chained],
            block_tables=table.block_tables(plan.slots[chained]),
            bitmasks=masks,
            sampling=plan.chain_sampling(chained, offsets[chained]),
        ),
        before_wait,
    )


def _confident(tokens, probs, k, min_confidence, at_most) -> Drafted:
    """The drafts kept: each chain stops before the first draft that takes its running
    minimum probability below min_confidence, and after at_most[i] drafts."""
    width = tokens.shape[1]
    fast = (k == width).all() and (at_most == k).all() and not np.isnan(probs).any()
    if fast and not (min_confidence > 0).any():
        # Nothing is cut: every draft of every state is kept.
        confidences = probs.min(axis=1).astype(np.float64)
        return Drafted(tokens, probs, k, confidences, k.copy(), tokens)
    valid = np.arange(width)[None, :] < k[:, None]
    running = np.minimum.accumulate(np.where(valid, probs, np.inf), axis=1)
    counts = np.minimum(((running >= min_confidence[:, None]) & valid).sum(axis=1), at_most)
    confidences = running[np.arange(len(k)), np.minimum(counts, k - 1)].astype(np.float64)
    kept = np.arange(width)[None, :] < counts[:, None]
    return Drafted(
        drafts=np.where(kept, tokens, -1),
        probs=np.where(kept, probs, 0).astype(np.float32),
        counts=counts,
        confidences=confidences,
        rows_computed=np.minimum(counts + 1, k),
        all_drafts=tokens,
    )


def draft_alone(ids: np.ndarray, probs: np.ndarray, rows, drafts: np.ndarray, kept) -> None:
    """Rows `rows` of a q ([B, width, support] ids and probabilities) as greedy drafts
    have it: each of `drafts` alone, probability 1, where `kept` ([r, width] or True);
    nothing elsewhere."""
    ids[rows], probs[rows] = 0, 0
    ids[rows, :, 0] = np.where(kept, drafts, 0)
    probs[rows, :, 0] = kept


def _kept_q(q: tuple[np.ndarray, np.ndarray], counts: np.ndarray):
    """q of the drafts kept (0 past each row's count), its support cut to the widest q."""
    ids, probs = q
    kept = np.arange(ids.shape[1])[None, :] < counts[:, None]
    probs = np.where(kept[..., None], probs, 0).astype(np.float32)
    ids = np.where(kept[..., None], ids, 0)
    support = max(int((probs > 0).sum(-1).max(initial=0)), 1)
    return ids[..., :support], probs[..., :support]
