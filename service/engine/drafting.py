"""The drafting itself: computes chains' rows and takes their drafts, for the engine.

It is handed the chains to advance (their states already hold the KV blocks the
rows need) and knows nothing of leases, limits or how the chains were chosen.
"""

from __future__ import annotations

import torch

from ..model.decode_chain import ChainInputs
from ..model.kv_cache import KVCache
from ..model.mtp_head import MTPHead
from .chain import Chain, VerdictPlan
from .rows import Segment, block_tables, draft_segments


def draft_all(
    head: MTPHead, kv: KVCache, chains: list[Chain], verdicts: list[VerdictPlan | None]
) -> None:
    """Every chain's drafts: one forward for rows that verdicts recompute, then one chain.

    A chain whose verdict recomputes rows (refeed hiddens, or the row of an
    accepted last draft) takes its first draft from a forward over those rows and
    R0; every other chain starts at R0 in the device-side chain of one-row steps.
    """
    recomputing = [
        (c, v.recompute)
        for c, v in zip(chains, verdicts, strict=True)
        if v is not None and v.recompute is not None
    ]
    if recomputing:
        first_drafts(head, kv, [c for c, _ in recomputing], [rows for _, rows in recomputing])
    active = [c for c in chains if not c.done]
    if active:
        chain_drafts(head, kv, active)


def first_drafts(
    head: MTPHead, kv: KVCache, chains: list[Chain], recomputed: list[Segment]
) -> None:
    """One forward: each state's recomputed verdict rows followed by its row R0."""
    segments = []
    for chain, rows in zip(chains, recomputed, strict=True):
        hidden = chain.args.hidden.reshape(1, -1)
        hiddens = torch.cat([rows.hiddens.to(head.device), hidden.to(head.device)])
        segments.append(
            Segment(chain.state, rows.start_row, [*rows.tokens, chain.args.token], hiddens)
        )
    masks = [c.mask_row() for c in chains]
    bitmask = None
    if any(m is not None for m in masks):
        full = torch.full_like(next(m for m in masks if m is not None), -1)
        bitmask = torch.stack([full if m is None else m for m in masks]).to(head.device)
    hidden, tokens, probs = draft_segments(head, kv, segments, bitmask)
    for chain, out, token, prob in zip(
        chains, hidden, tokens.tolist(), probs.tolist(), strict=True
    ):
        chain.last_hidden = out
        chain.rows_computed += 1
        chain.take(token, prob)


def _chain_bitmasks(chains: list[Chain], steps: int) -> torch.Tensor | None:
    """[steps, n, W] int32: each chain's mask for each of its next drafts (all-ones if none)."""
    masked = [(i, c.bitmask) for i, c in enumerate(chains) if c.bitmask is not None]
    if not masked:
        return None
    words = masked[0][1].shape[1]
    out = torch.full((steps, len(chains), words), -1, dtype=torch.int32)
    for i, mask in masked:
        # A mask of fewer rows than drafts repeats its last row.
        rows = (len(chains[i].drafts) + torch.arange(steps)).clamp_max(mask.shape[0] - 1)
        out[:, i] = mask[rows]
    return out


def _rows(hiddens: list[torch.Tensor]) -> torch.Tensor:
    """[n, H] from rows of [H] (the usual) or [1, H]: one torch call when they agree, as
    each torch call on the engine thread hands the GIL to the event loop."""
    if all(h.dim() == 1 for h in hiddens):
        return torch.stack(hiddens)
    return torch.cat([h if h.dim() == 2 else h[None] for h in hiddens])


def chain_drafts(head: MTPHead, kv: KVCache, chains: list[Chain]) -> None:
    """The remaining drafts of every chain in one device-side chain of decode steps."""
    limits = [c.args.num_drafts - len(c.drafts) for c in chains]
    starts = [c.next_input() for c in chains]
    hiddens = [h for _, h, _ in starts]
    if len({h.device for h in hiddens}) > 1:  # fresh chains' hiddens on the host, others not
        hiddens = [h.to(head.device) for h in hiddens]
    out = head.decode_chain(
        kv,
        ChainInputs(
            tokens=torch.tensor([t for t, _, _ in starts], dtype=torch.int64),
            hiddens=_rows(hiddens),
            positions=torch.tensor([row for _, _, row in starts], dtype=torch.int64),
            limits=torch.tensor(limits, dtype=torch.int64),
            block_tables=block_tables([c.state for c in chains]),
            bitmasks=_chain_bitmasks(chains, max(limits)),
        ),
    )
    last_step = [0] * len(chains)
    for j, (tokens, probs) in enumerate(zip(out.tokens, out.probs, strict=True)):
        for i, c in enumerate(chains):
            if j < limits[i] and not c.done:
                last_step[i] = j
                c.rows_computed += 1
                c.take(tokens[i], probs[i])
    # One torch call for them all, not one index per chain (~3 us each, which lets go of
    # the GIL): a view of the last step when every chain ran every step, else a gather.
    if len(set(last_step)) == 1:
        last_hiddens = out.hiddens[last_step[0]]
    else:
        last_hiddens = out.hiddens[last_step, list(range(len(chains)))]
    for c, hidden in zip(chains, last_hiddens.unbind(0), strict=True):
        c.last_hidden = hidden
