"""The drafting itself: computes chains' rows and takes their drafts, for the engine.

It is handed the chains to advance (their states already hold the KV blocks the
rows need) and knows nothing of leases, limits or how the chains were chosen.
"""

from __future__ import annotations

import torch

from ..model.kv_cache import KVCache
from ..model.mtp_head import MTPHead
from .chain import Chain, VerdictPlan
from .rows import Segment, block_tables, draft_segments


def first_drafts(
    head: MTPHead, kv: KVCache, chains: list[Chain], verdicts: list[VerdictPlan | None]
) -> None:
    """One forward: each state's verdict rows (if any) followed by its row R0."""
    segments = []
    for chain, verdict in zip(chains, verdicts, strict=True):
        r0 = Segment(chain.state, chain.base_row, [chain.args.token], chain.args.hidden)
        if verdict is not None and verdict.recompute is not None:
            rows = verdict.recompute
            r0 = Segment(
                chain.state,
                rows.start_row,
                rows.tokens + r0.tokens,
                torch.cat([rows.hiddens, r0.hiddens]),
            )
        segments.append(r0)
    draft_step(head, kv, chains, segments)


def draft_step(head: MTPHead, kv: KVCache, chains: list[Chain], segments: list[Segment]) -> None:
    """Computes each chain's next rows and drafts its next token from the last one."""
    masks = [c.mask_row() for c in chains]
    bitmask = None
    if any(m is not None for m in masks):
        full = torch.full_like(next(m for m in masks if m is not None), -1)
        bitmask = torch.stack([full if m is None else m for m in masks])
    hidden, tokens, probs = draft_segments(head, kv, segments, bitmask)
    hidden = hidden.clone()  # a graph's outputs are overwritten by its next replay
    for chain, out, token, prob in zip(
        chains, hidden, tokens.tolist(), probs.tolist(), strict=True
    ):
        chain.last_hidden = out
        chain.rows_computed += 1
        chain.take(token, prob)


def chain_drafts(head: MTPHead, kv: KVCache, chains: list[Chain]) -> None:
    """Drafts 2..K of every chain in one device-side chain of decode steps."""
    device = head.device
    limits = [c.args.num_drafts - len(c.drafts) for c in chains]
    steps = max(limits)
    bitmasks = None
    if any(c.bitmask is not None for c in chains):
        words = next(c.bitmask for c in chains if c.bitmask is not None).shape[1]
        full = torch.full((words,), -1, dtype=torch.int32, device=device)
        bitmasks = torch.stack([
            torch.stack([
                full if c.bitmask is None
                else c.bitmask[min(len(c.drafts) + j, c.bitmask.shape[0] - 1)]
                for c in chains
            ])
            for j in range(steps)
        ])  # fmt: skip
    out_h, out_t, out_p = head.decode_chain(
        kv,
        torch.tensor([c.drafts[-1] for c in chains], dtype=torch.int64, device=device),
        torch.stack([c.last_hidden for c in chains]),
        torch.tensor([c.base_row + c.rows_computed for c in chains], device=device),
        block_tables([c.state for c in chains], device),
        torch.tensor(limits, device=device),
        bitmasks,
    )
    tokens, probs = out_t.tolist(), out_p.tolist()  # the chain's one wait for the device
    for j in range(steps):
        for i, c in enumerate(chains):
            if j < limits[i] and not c.done:
                c.last_hidden = out_h[j, i]
                c.rows_computed += 1
                c.take(tokens[j][i], probs[j][i])
