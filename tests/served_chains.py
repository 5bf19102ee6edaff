"""A verifier's state driven over gRPC, every draft checked against a float64 oracle within
what the compute dtype may change (tests/precision.py).

The oracle is teacher-forced with the served drafts: each served draft must be the oracle's
top-1 at that step, or tie with it within the dtype's rounding, and its probability must
be the oracle's within twice that; the chain goes on from the served token, so one tie
does not end the comparison. The oracle's `route` hook, made fresh for every draft by
`route()`, sees each MoE row's choice. A chain that routed a row by less than
ROUTING_ROUNDINGS may differ from the oracle from that row on (a routing flip): a draft
there that misses the tolerance is counted as flipped instead of failing, and a verdict
keeps none of the rows such a chain computed after that row (the driver refeeds them).
With a route that makes the oracle route as the service did (precision.Forced) nothing
is excused.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from deepseek_checkpoints import write_deepseek_checkpoint
from deepseek_reference import DeepseekReference
from family_checkpoints import write_family_checkpoint
from family_reference import FamilyReference
from mtp_reference import Reference
from precision import UNIT_ROUNDOFF, Margins, tie_gap

from mtpdraft.client import Verdict
from mtpdraft.service.model.synthetic import write_random_checkpoint

# Each family's tiny checkpoint, and prompts long enough to reach its RoPE regime: past
# the YaRN band's original_max_position_embeddings (1024 in DeepSeek's tiny config).
PROMPT_ROWS = {
    "mimo": 240,
    "glm-4.5": 240,
    "qwen3-next": 240,
    "qwen3.6-dense": 240,
    "deepseek-v3": 1100,
    "deepseek-v3-fp8": 1100,
}


def bf16_checkpoint(folder, name: str):
    """A tiny checkpoint of `name` (a PROMPT_ROWS key) in `folder`, in bf16 as published
    (DeepSeek's "-fp8": its FP8 weights); returns its float64 oracle."""
    if name == "mimo":
        return Reference(write_random_checkpoint(folder, "mimo", dtype=torch.bfloat16, seed=5))
    if name.startswith("deepseek"):
        fp8 = name.endswith("fp8")
        write_deepseek_checkpoint(folder, "deepseek-v3", dtype=torch.bfloat16, seed=5, fp8=fp8)
        return DeepseekReference(folder)
    extra = {"n_group": 2, "topk_group": 1} if name == "glm-4.5" else {}  # group-limited
    write_family_checkpoint(folder, name, dtype=torch.bfloat16, seed=5, **extra)
    return FamilyReference(folder)


@dataclass
class Tally:
    checked: int = 0  # drafts within the tolerance
    flipped: int = 0  # drafts off it after a routing near tie of their chain
    worst_gap: float = 0.0  # the largest oracle top-1 logit minus a checked draft's
    worst_log_prob: float = 0.0  # the largest |log p served - log p oracle| checked
    by_index: dict = field(default_factory=dict)  # draft index -> [checked, flipped]

    def add(self, other: Tally) -> None:
        self.checked += other.checked
        self.flipped += other.flipped
        self.worst_gap = max(self.worst_gap, other.worst_gap)
        self.worst_log_prob = max(self.worst_log_prob, other.worst_log_prob)
        for j, (checked, flipped) in other.by_index.items():
            counts = self.by_index.setdefault(j, [0, 0])
            counts[0] += checked
            counts[1] += flipped


class Sequence:
    """One state's committed rows as the contract defines them, and the oracle's view."""

    def __init__(self, ref, client, n: int, seed: int, dtype: str, u: float, route=None):
        self.ref, self.client, self.dtype, self.u = ref, client, dtype, u
        self.route = route or (lambda: Margins(UNIT_ROUNDOFF[dtype]))
        self.gen = torch.Generator().manual_seed(seed)
        self.tally = Tally()
        self.tokens = self.random_tokens(n)
        wire = self.random_hiddens(n)
        self.hiddens = wire.double()  # the rows' hiddens, as the oracle reads them
        self.pending: tuple[list[int], list[torch.Tensor], int] | None = None
        self.state = client.alloc_state()
        result = client.prefill(self.state, self.tokens, wire, start_position=1)
        assert result.next_position == n + 1

    def random_tokens(self, n: int) -> list[int]:
        vocab = self.ref.cfg.get("vocab_size") or self.ref.text["vocab_size"]
        return torch.randint(0, vocab, (n,), generator=self.gen).tolist()

    def random_hiddens(self, n: int) -> torch.Tensor:
        h = self.ref.hidden if hasattr(self.ref, "hidden") else self.ref.cfg["hidden_size"]
        # bf16 on the wire, so that the oracle reads exactly what the server reads
        return torch.randn(n, h, generator=self.gen).to(torch.bfloat16)

    @property
    def position(self) -> int:
        return len(self.tokens) + 1

    def next_input(self) -> tuple[int, torch.Tensor]:
        return self.random_tokens(1)[0], self.random_hiddens(1)[0]

    def check(self, token, hidden, got, allowed=None) -> tuple[list[float], list[float]]:
        """Checks a proposal for (token, hidden) and records it as pending; returns the
        oracle's probability of each draft and its tie gap."""
        assert got.first_position == self.position + 1
        tokens = [*self.tokens, token]
        hiddens = torch.cat([self.hiddens, hidden.double()[None]])
        r0 = len(tokens) - 1  # the row index of the proposal's committed row
        outs, probs, gaps, near_tie = [], [], [], None
        for j, draft in enumerate(got.tokens):
            route = self.route()
            out = self.ref.rows(tokens, hiddens, step=j, route=route)[-1]
            if near_tie is None and route.near_tie(range(r0, r0 + j + 1)):
                near_tie = j  # a row of this chain was routed within the dtype's rounding
            logits = self.ref.logits(out, step=j)
            if allowed is not None:
                logits = logits.masked_fill(~allowed[min(j, len(allowed) - 1)], -math.inf)
            gap = tie_gap(logits, self.u)
            prob = float(logits.softmax(-1)[draft])
            self._check_draft(j, draft, got.probs[j], logits, prob, gap, near_tie is not None)
            probs.append(prob)
            gaps.append(gap)
            outs.append(out)
            tokens.append(draft)
            hiddens = torch.cat([hiddens, out[None]])
        self.tokens.append(token)
        self.hiddens = torch.cat([self.hiddens, hidden.double()[None]])
        self.pending = (list(got.tokens), outs, len(got.tokens) if near_tie is None else near_tie)
        return probs, gaps

    def _check_draft(self, j, draft, served_prob, logits, prob, gap, near_tie) -> None:
        t, top = self.tally, float(logits.max())
        counts = t.by_index.setdefault(j, [0, 0])
        behind, off = top - float(logits[draft]), abs(math.log(served_prob) - math.log(prob))
        if behind <= gap and off <= 2 * gap:
            counts[0] += 1
            t.checked += 1
            t.worst_gap, t.worst_log_prob = max(t.worst_gap, behind), max(t.worst_log_prob, off)
            return
        assert near_tie, (
            f"draft {j}: {draft} (p {served_prob:.4g}) against the oracle's top-1 "
            f"{int(logits.argmax())}: {behind:.3g} logits behind it (a tie within {gap:.3g}), "
            f"probability {prob:.4g}"
        )
        counts[1] += 1
        t.flipped += 1

    def keeps_resolved_rows(self, accepted: int) -> bool:
        """Whether accepting `accepted` drafts without refeed keeps only rows the oracle
        computes as the service did: row R(i) reads m(i-1), which a near tie at row
        i - 1 or before may have changed."""
        return accepted <= self.pending[2]

    def verdict(self, accepted: int, refeed: torch.Tensor | None = None) -> None:
        drafts, outs, _ = self.pending
        assert refeed is not None or self.keeps_resolved_rows(accepted)
        self.pending = None
        for i in range(accepted):
            self.tokens.append(drafts[i])
            row = refeed[i] if refeed is not None else outs[i]
            self.hiddens = torch.cat([self.hiddens, row.double()[None]])


def random_session(seq: Sequence, steps: int, k: int, seed: int) -> Tally:
    """`steps` proposals of K drafts on one state with random verdicts: none, some or all
    accepted, own hiddens or refed (always refed past a near tie), AfterVerify or
    carried by the next Propose. Frees the state."""
    rng, client, previous = random.Random(seed), seq.client, None
    try:
        for _ in range(steps):
            token, hidden = seq.next_input()
            got = client.propose(seq.state, token, hidden, seq.position, k, previous=previous)
            assert len(got.tokens) == k
            seq.check(token, hidden, got)
            accepted = rng.choice([0, rng.randint(1, k), k])
            refeed = rng.random() < 0.5 or not seq.keeps_resolved_rows(accepted)
            hiddens = seq.random_hiddens(accepted) if refeed and accepted else None
            seq.verdict(accepted, hiddens)
            previous = Verdict(accepted, hiddens)
            if rng.random() < 0.5:
                client.after_verify(seq.state, accepted, refeed_hiddens=hiddens)
                previous = None
        if previous is not None:  # the last verdict, which no next Propose carries
            client.after_verify(
                seq.state, previous.num_accepted, refeed_hiddens=previous.refeed_hiddens
            )
    finally:
        client.free_state(seq.state)
    return seq.tally
