"""Drafting for states with a grammar: every draft is one the state's grammar allows.

A grammar state's mask for draft j + 1 depends on draft j, which the device has just
drafted, so its chain runs one step at a time: each step masks the head's logits with
the grammar's bitmask at that point (ANDed with the client's bitmask row, if it sent
one), and the state's matcher moves on by the draft; after the chain every matcher is
moved back to where the verifier's sequence stands. A state's chain stops before K where
its grammar allows nothing more (it has ended, or it may only end and the vocabulary
has no stop token), and at min_confidence as any chain does. States without a grammar
are drafted as before (drafting.draft, one device-side chain), after the grammar states,
whose outputs are copies by then.
"""

from __future__ import annotations

import numpy as np
import torch

from ..grammar.states import StateGrammars
from ..model.decode_chain import BeforeWait, ChainInputs
from ..model.kv_cache import KVCache
from ..model.mtp_head import MTPHead
from . import draft_count
from .drafting import ChainPlan, Drafted, draft
from .rows import Segment, draft_segments
from .state import StateTable


def draft_with_grammars(
    head: MTPHead,
    kv: KVCache,
    table: StateTable,
    plan: ChainPlan,
    before_wait: BeforeWait | None,
    grammars: StateGrammars,
) -> tuple[Drafted, torch.Tensor, dict[int, torch.Tensor]]:
    """drafting.draft's answer for every state of the plan, grammar states drafted under
    their grammars, and each grammar state's masks (draft_grammar_states) by its row of
    the plan. `before_wait` runs only where no state has a grammar: its hiddens are the
    whole plan's."""
    with_grammar = grammars.which(plan.slots)
    if not with_grammar.any():
        return (*draft(head, kv, table, plan, before_wait), {})
    if with_grammar.all():
        return draft_grammar_states(head, kv, table, plan, grammars)
    own, rest = np.flatnonzero(with_grammar), np.flatnonzero(~with_grammar)
    drafted, hiddens, masks = draft_grammar_states(head, kv, table, _subplan(plan, own), grammars)
    free = draft(head, kv, table, _subplan(plan, rest))
    merged = _merged(plan, (own, drafted, hiddens), (rest, *free))
    return (*merged, {int(own[i]): m for i, m in masks.items()})


def draft_grammar_states(
    head: MTPHead, kv: KVCache, table: StateTable, plan: ChainPlan, grammars: StateGrammars
) -> tuple[Drafted, torch.Tensor, dict[int, torch.Tensor]]:
    """The drafts of states that all have a grammar, step by step (greedy or sampled as
    each state's sampling says: a sampled draft's q is the masked distribution); each
    one's last computed row's output hidden ([n, H] on the device, a copy); and each one's
    grammar masks, [count + 1, W] int32 on the host: row j the grammar's at draft j + 1's
    position (the client's bitmask not applied), the last row the bonus position's after
    every draft (all zero where the grammar has ended), for a verifier to mask its logits."""
    n, k = len(plan.slots), plan.num_drafts
    width, slots = int(k.max()), plan.slots.tolist()
    drafts = np.full((n, width), -1, np.int64)
    probs = np.zeros((n, width), np.float32)
    drawn = np.zeros((n, width), np.float32)  # every draft's probability, a cut one's too
    q = None  # each kept draft's q, when some state samples
    if plan.samples:
        support = min(plan.support, head.config.vocab_size)
        q = (np.zeros((n, width, support), np.int64), np.zeros((n, width, support), np.float32))
    counts = np.zeros(n, np.int64)
    rows_computed = np.ones(n, np.int64)  # R0 at least
    advanced = np.zeros(n, np.int64)  # drafts each matcher moved on by, undone at the end
    outputs = []  # step j: (the states that computed R(j), its output hiddens)
    live = np.arange(n)  # the states whose chain goes on
    grammar = grammars.masks(slots)
    seen: list[list[torch.Tensor]] = [[row] for row in grammar]  # each state's masks
    masks = _with_client_masks(grammar.clone(), plan, live, 0)
    allowed = masks.ne(0).any(dim=1).numpy()
    # R0 is computed whatever the grammar says (it is a committed row); a state whose
    # grammar allows nothing takes no draft from it.
    unmasked = torch.where(torch.from_numpy(allowed)[:, None], masks, -1)
    hidden, chosen = _first_step(head, kv, table, plan, unmasked)
    outputs.append((live, hidden))
    live, chosen = live[allowed], _rows(chosen, allowed)
    try:
        for j in range(width):
            # `chosen`: draft j + 1 of each live state, from its row R(j).
            rows_computed[live] = j + 1
            drawn[live, j] = chosen[1]
            running = drawn[live, : j + 1].min(axis=1)
            kept = running >= plan.min_confidence[live]  # else not kept, and the end
            live, chosen = live[kept], _rows(chosen, kept)
            drafts[live, j], probs[live, j], counts[live] = chosen[0], chosen[1], j + 1
            if q is not None:
                q[0][live, j], q[1][live, j] = chosen[2], chosen[3]
            ended = grammars.advance([slots[i] for i in live], chosen[0].tolist())
            advanced[live] += 1
            live = live[~ended & (k[live] > j + 1)]
            if not len(live):
                break
            grammar = grammars.masks([slots[i] for i in live])
            for i, row in zip(live.tolist(), grammar, strict=True):
                seen[i].append(row)
            masks = _with_client_masks(grammar.clone(), plan, live, j + 1)
            allowed = masks.ne(0).any(dim=1).numpy()
            live, masks = live[allowed], masks[torch.from_numpy(allowed)]
            if not len(live):
                break
            before, hiddens = outputs[j]
            at = torch.from_numpy(np.searchsorted(before, live)).to(hiddens.device)
            hidden, chosen = _next_step(
                head, kv, table, plan, live, j + 1, drafts[live, j], hiddens[at], masks
            )
            outputs.append((live, hidden))
        # A chain that drafted K, or whose last draft ended the grammar, lacks the bonus
        # position's mask: the grammar's after its last draft.
        short = [i for i in range(n) if len(seen[i]) == counts[i]]
        for i, row in zip(short, grammars.masks([slots[i] for i in short]), strict=True):
            seen[i].append(row)
    finally:
        grammars.rollback(slots, advanced.tolist())
    _chosen_counts(plan, drafts, probs, q, counts, rows_computed, seen)
    # The chain confidence: the running minimum, through the first draft not kept.
    through = np.minimum(counts + 1, rows_computed)  # >= 1
    upto = np.arange(width)[None, :] < through[:, None]
    confidences = np.where(upto, drawn, np.inf).min(axis=1)
    confidences[drawn[:, 0] == 0] = 0.0  # no draft drawn: the grammar allowed none
    last = torch.empty(n, head.config.hidden_size, dtype=head.dtype, device=head.device)
    for step, (rows, hiddens) in enumerate(outputs):
        ends = np.flatnonzero(rows_computed[rows] == step + 1)
        if len(ends):
            last[torch.from_numpy(rows[ends]).to(head.device)] = hiddens[
                torch.from_numpy(ends).to(hiddens.device)
            ]
    drafted = Drafted(drafts, probs, counts, confidences.astype(np.float64), rows_computed, drafts)
    if q is not None:
        drafted.q_ids, drafted.q_probs = _cut_support(*q)
    return drafted, last, {i: torch.stack(rows) for i, rows in enumerate(seen)}


def _chosen_counts(plan: ChainPlan, drafts, probs, q, counts, rows_computed, seen) -> None:
    """Where the drafter chooses how many drafts to keep (num_drafts 0, draft_count.py),
    its choice among the grammar's drafts: the rest are dropped, the row of the first one
    dropped stays computed, and the masks end at its position."""
    chooses = np.flatnonzero(~np.isnan(plan.verify_costs))
    if not len(chooses):
        return
    at_most = draft_count.counts(
        probs[chooses], counts[chooses], plan.calibration[chooses], plan.verify_costs[chooses]
    )
    for i, keep in zip(chooses.tolist(), at_most.tolist(), strict=True):
        if keep < counts[i]:
            drafts[i, keep:], probs[i, keep:], counts[i] = -1, 0, keep
            rows_computed[i] = keep + 1
            seen[i][keep + 1 :] = []
            if q is not None:
                q[0][i, keep:], q[1][i, keep:] = 0, 0


def _cut_support(ids: np.ndarray, probs: np.ndarray):
    """q with its support cut to the widest q kept (0 past each row's count already)."""
    support = max(int((probs > 0).sum(-1).max(initial=0)), 1)
    return ids[..., :support], probs[..., :support]


def _rows(chosen: tuple, keep: np.ndarray) -> tuple:
    """The drafts chosen (tokens, probs, q ids, q probs: numpy) of the rows kept."""
    return tuple(None if c is None else c[keep] for c in chosen)


def _first_step(head, kv, table, plan: ChainPlan, masks: torch.Tensor):
    """R0 of every state (after the rows its verdict recomputes, if any) and the draft
    from it under `masks`: (output hiddens [n, H] on the device, the drafts chosen)."""
    n = len(plan.slots)
    if plan.recompute:
        again = dict(plan.recompute)
        segments = []
        for i, slot in enumerate(plan.slots.tolist()):
            r0 = plan.hiddens[i : i + 1]
            if i in again:
                seg = again[i]
                hiddens = torch.cat(
                    [seg.hiddens.to(head.device, head.dtype), r0.to(head.device, head.dtype)]
                )
                tokens = np.append(seg.tokens, plan.tokens[i])
                segments.append(Segment(slot, seg.start_row, tokens, hiddens))
            else:
                segments.append(Segment(slot, int(plan.base_rows[i]), plan.tokens[i : i + 1], r0))
        sampling = plan.chain_sampling(np.arange(n), np.zeros(n, np.int64))
        hidden, chosen = draft_segments(head, kv, table, segments, masks.to(head.device), sampling)
        q = (None, None) if sampling is None else (chosen.q_ids, chosen.q_probs)
        picked = (chosen.tokens, chosen.probs.float(), *q)
        return hidden, tuple(None if t is None else t.cpu().numpy() for t in picked)
    live = np.arange(n)
    return _next_step(head, kv, table, plan, live, 0, plan.tokens, plan.hiddens, masks)


def _next_step(head, kv, table, plan: ChainPlan, live, j: int, tokens, hiddens, masks):
    """Row R(j) of each live state (token, hidden given) and draft j + 1 from it."""
    out = head.decode_chain(
        kv,
        ChainInputs(
            tokens=np.asarray(tokens, np.int64),
            hiddens=hiddens,
            positions=plan.base_rows[live] + j,
            limits=np.ones(len(live), np.int64),
            block_tables=table.block_tables(plan.slots[live]),
            bitmasks=masks[None],
            sampling=plan.chain_sampling(live, np.full(len(live), j, np.int64)),
        ),
    )
    q = (None, None) if out.q_ids is None else (out.q_ids[0], out.q_probs[0])
    # The chain's outputs may live in buffers the next chain reuses: copied.
    return out.hiddens[0].clone(), (out.tokens[0], out.probs[0], *q)


def _with_client_masks(masks: torch.Tensor, plan: ChainPlan, rows: np.ndarray, j: int):
    """The grammar's masks ANDed with the client's row for draft j + 1, where it sent one
    (a mask of fewer rows than drafts repeats its last row)."""
    counts = plan.mask_counts[rows]
    sent = np.flatnonzero(counts > 0)
    if not len(sent):
        return masks
    index = plan.mask_starts[rows[sent]] + np.minimum(j, counts[sent] - 1)
    masks[torch.from_numpy(sent)] &= plan.bitmasks[torch.from_numpy(index)]
    return masks


def _subplan(plan: ChainPlan, rows: np.ndarray) -> ChainPlan:
    """The plan of some of its states (rows ascending): the client's bitmasks stay whole,
    their starts index them."""
    renumber = {int(i): j for j, i in enumerate(rows.tolist())}
    return ChainPlan(
        slots=plan.slots[rows],
        tokens=plan.tokens[rows],
        hiddens=plan.hiddens[torch.from_numpy(rows)],
        base_rows=plan.base_rows[rows],
        num_drafts=plan.num_drafts[rows],
        min_confidence=plan.min_confidence[rows],
        mask_starts=plan.mask_starts[rows],
        mask_counts=plan.mask_counts[rows],
        bitmasks=plan.bitmasks,
        recompute=[(renumber[i], seg) for i, seg in plan.recompute if i in renumber],
        sampling=plan.sampling[rows],
        state_ids=plan.state_ids[rows],
        support=plan.support,
        verify_costs=plan.verify_costs[rows],
        calibration=plan.calibration[rows],
    )


def _merged(plan: ChainPlan, *parts) -> tuple[Drafted, torch.Tensor]:
    """The answers of parts of a plan, (rows, Drafted, last hiddens) each, in its order."""
    n, width = len(plan.slots), int(plan.num_drafts.max())
    drafts = np.full((n, width), -1, np.int64)
    every = drafts.copy()
    probs = np.zeros((n, width), np.float32)
    counts, rows_computed = np.zeros(n, np.int64), np.zeros(n, np.int64)
    confidences = np.zeros(n, np.float64)
    sampled = [d for _, d, _ in parts if d.q_ids is not None]
    q = None
    if sampled:
        support = max(d.q_ids.shape[2] for d in sampled)
        q = (np.zeros((n, width, support), np.int64), np.zeros((n, width, support), np.float32))
    hiddens = None
    for rows, d, h in parts:
        w = d.drafts.shape[1]
        drafts[rows, :w], probs[rows, :w] = d.drafts, d.probs
        every[rows, : d.all_drafts.shape[1]] = d.all_drafts
        counts[rows], rows_computed[rows], confidences[rows] = (
            d.counts, d.rows_computed, d.confidences
        )  # fmt: skip
        if d.q_ids is not None:
            support = d.q_ids.shape[2]
            q[0][rows, :w, :support], q[1][rows, :w, :support] = d.q_ids, d.q_probs
        elif q is not None:  # a greedy part's q: each draft alone, probability 1
            kept = np.arange(w)[None, :] < d.counts[:, None]
            q[0][rows, :w, 0] = np.where(kept, d.drafts, 0)
            q[1][rows, :w, 0] = kept
        if hiddens is None:
            hiddens = h.new_empty(n, h.shape[1])
        hiddens[torch.from_numpy(rows).to(h.device)] = h
    drafted = Drafted(drafts, probs, counts, confidences, rows_computed, every)
    if q is not None:
        drafted.q_ids, drafted.q_probs = q
    return drafted, hiddens
