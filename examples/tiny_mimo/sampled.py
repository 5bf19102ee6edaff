"""Speculative sampling with the tiny MiMo: drafts sampled by mtpdraft, verified by the target.

A verifier that samples at temperature T runs, per step and for a batch of sequences: K
drafts from the drafter (each drawn from q, its q returned with it), one target forward
over [last token, d1..dK] (p at each of the K + 1 positions, softmax(logits / T)), and
``mtpdraft.client.sampling.accept``, which keeps draft j with probability min(1, p/q),
draws the correction from max(p - q, 0) at the first refusal, and the bonus token from p
when every draft is kept. The tokens emitted then follow the target's own sampling
distribution exactly, whatever q is; q decides how many drafts are kept.

``speculate`` runs that loop for a batch of sequences that share a prompt, against a
DraftEngine in this process (the path the server serves; the wire changes no draft),
and records every token emitted with the target's distribution it should follow. The
drafts are sampled (``sampled=True``, q as the drafter returns it) or greedy (q one-hot).
``q_given`` says what q the verifier is handed instead of the drafter's: "one_hot" (each
draft alone: exact whatever drew the drafts, as max(p - q, 0) then removes exactly the
draft's mass, so only fewer drafts are kept) or "shifted" (each draft given the next
draft's q: a q that is not the drafts' law, which a test must catch).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mtpdraft.client.sampling import accept
from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine import columns
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.sampling import Sampling
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead

from .model import KVCache, TinyMiMoForCausalLM, load_checkpoint
from .verify import find_trained_checkpoint


@dataclass
class Speculated:
    """Every token emitted: its slot in its verify step (j: the j-th token the step
    emitted), the token, and the target's distribution p at its position; and per verify
    step, the drafts accepted and the sequence it was of."""

    slots: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    target: list[np.ndarray] = field(default_factory=list)  # [V] float64 each
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)  # drafts handed to the verifier
    sequences: list[int] = field(default_factory=list)


def report_arguments(doc: str) -> argparse.ArgumentParser:
    """The arguments the reports share: the held-out prompts and sequences each runs on."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--per-prompt", type=int, default=4, help="sequences per prompt")
    p.add_argument("--prompt-len", type=int, default=64, help="bytes per prompt")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--report-dir", type=Path)
    return p


def trained(max_drafts: int, **config) -> tuple[TinyMiMoForCausalLM, DraftEngine]:
    """The trained tiny MiMo's target and a DraftEngine on its MTP head, both float32 on
    the CPU (one torch thread); `config`: more ServeConfig fields."""
    folder = find_trained_checkpoint()
    if folder is None:
        raise SystemExit("the trained tiny MiMo is not here")
    torch.set_num_threads(1)
    head = MTPHead(load_mtp_weights(folder), torch.device("cpu"), torch.float32)
    engine = DraftEngine(head, ServeConfig(kv_blocks=4096, max_drafts=max_drafts, **config))
    return load_checkpoint(folder, torch.float32), engine


class _Sequence:
    """One sequence on the target: its tokens and KV cache."""

    def __init__(self, model: TinyMiMoForCausalLM, prompt: list[int], max_len: int) -> None:
        self.model, self.tokens = model, list(prompt)
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(model.config, 1, max_len, dtype)

    @torch.no_grad()
    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends tokens at the cache's end: their hiddens [n, H] fp32, logits [n, V] fp64."""
        h = self.model.forward_target(torch.tensor([tokens]), self.cache)[0]
        return h.float(), self.model.target_logits(h).double()


def speculate(
    model: TinyMiMoForCausalLM,
    engine: DraftEngine,
    prompt: list[int],
    *,
    batch: int,
    k: int,
    temperature: float,
    new_tokens: int,
    seed: int,
    rng: np.random.Generator,
    sampled: bool = True,
    q_given: str | None = None,
    verify_token_cost: float | None = None,
) -> Speculated:
    """`batch` sequences after `prompt` (its last token is the first proposed), each run
    until it emitted `new_tokens` tokens; their drafter states seeded `seed`. Temperature
    0 verifies greedily (p one-hot at the target's argmax). With `verify_token_cost`
    the drafter chooses how many drafts, up to `k`, for that cost of a verify token."""
    n = len(prompt)
    seqs = [_Sequence(model, prompt, n + new_tokens + k + 2) for _ in range(batch)]
    hiddens, _ = seqs[0].forward(prompt[:-1])  # h_0 .. h_(n-2): the drafter's rows
    first = seqs[0].cache
    for s in seqs[1:]:  # the prompt's KV, computed once
        for kept, given in zip(s.cache.k + s.cache.v, first.k + first.v, strict=True):
            kept.copy_(given)
        s.cache.length = n - 1
    sampling = Sampling(temperature, seed=seed) if sampled and temperature > 0 else Sampling()
    chooses = verify_token_cost is not None
    states = [engine.alloc_state(sampling=sampling) for _ in range(batch)]
    out = Speculated()
    try:
        for state in states:
            session = engine.begin_prefill(state, 1)
            session.append(prompt[1:-1], hiddens[: n - 2])
            session.finish()
        last_hidden = [hiddens[n - 2]] * batch
        accepted, refeed = [-1] * batch, [None] * batch
        running = list(range(batch))
        while running:
            result = engine.step(
                columns.step(
                    engine.step_shape,
                    state_ids=[states[i] for i in running],
                    tokens=[seqs[i].tokens[-1] for i in running],
                    positions=[len(seqs[i].tokens) - 1 for i in running],
                    hiddens=torch.stack([last_hidden[i] for i in running]),
                    num_drafts=[0 if chooses else k],
                    draft_caps=[k],
                    verify_token_costs=[verify_token_cost or 0.0],
                    num_accepted=[accepted[i] for i in running],
                    refeed_rows=[0 if refeed[i] is None else len(refeed[i]) for i in running],
                    refeed_hiddens=_rows([refeed[i] for i in running]),
                )
            )
            assert not result.errors, result.errors
            drafts = result.drafts
            q_ids, q_probs = result.q_ids, result.q_probs
            if q_ids is None or q_given == "one_hot":  # the drafts alone
                q_ids, q_probs = drafts[..., None], np.ones((*drafts.shape, 1))
            elif q_given == "shifted":
                q_ids, q_probs = np.roll(q_ids, -1, axis=1), np.roll(q_probs, -1, axis=1)
            # One target forward per sequence over [last token, d1..dK].
            counts = result.counts
            rows = [seqs[i].forward([seqs[i].tokens[-1], *drafts[j, : counts[j]].tolist()])
                    for j, i in enumerate(running)]  # fmt: skip
            p = np.zeros((len(running), k + 1, model.config.vocab_size))
            for j, (_, logits) in enumerate(rows):
                p[j, : counts[j] + 1] = _target_probs(logits, temperature)
            verdict = accept(drafts, q_ids, q_probs, p, counts=counts, rng=rng)
            for j, i in enumerate(running):
                a, token = int(verdict.num_accepted[j]), int(verdict.next_tokens[j])
                emitted = [*drafts[j, :a].tolist(), token]
                out.slots += range(len(emitted))
                out.tokens += emitted
                out.target += list(p[j, : a + 1])
                out.accepted.append(a)
                out.drafted.append(int(counts[j]))
                out.sequences.append(i)
                s = seqs[i]
                s.cache.truncate(len(s.tokens) + a)  # keeps the last token and d1..da
                s.tokens += emitted
                target_h = rows[j][0]
                accepted[i], refeed[i] = a, target_h[:a] if a else None
                last_hidden[i] = target_h[a]
            running = [i for i in running if len(seqs[i].tokens) - n < new_tokens]
        return out
    finally:
        for state in states:
            engine.free_state(state)


def _target_probs(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """The target's sampling distribution: softmax(logits / T), or at T = 0 its argmax."""
    if temperature > 0:
        return torch.softmax(logits / temperature, -1).numpy()
    return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double().numpy()


def _rows(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    kept = [p for p in parts if p is not None]
    return torch.cat(kept) if kept else None


def rank_chi_square(out: Speculated, slot: int, bins: int = 12) -> tuple[float, int, int]:
    """Whether the tokens of one slot follow their target distributions: each token's
    rank under its own p (most probable first), counted in rank bins (the last holds every
    rank past bins - 2), against the counts the p's expect. (Pearson's chi-square, its
    degrees of freedom, the tokens counted.) Tokens drawn from different p's are a sum of
    independent categorical draws, whose counts vary less than a multinomial's: the
    statistic is at most chi-square distributed, so its critical value is conservative."""
    picked = [i for i, s in enumerate(out.slots) if s == slot]
    observed, expected = np.zeros(bins), np.zeros(bins)
    for i in picked:
        p = out.target[i]
        order = np.argsort(-p, kind="stable")
        rank = int(np.flatnonzero(order == out.tokens[i])[0])
        observed[min(rank, bins - 1)] += 1
        mass = p[order]
        expected[: bins - 1] += mass[: bins - 1]
        expected[bins - 1] += mass[bins - 1 :].sum()
    # Bins expecting fewer than 5 tokens join their neighbour (the approximation's rule).
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] < 5:
        obs, exp = np.append(obs[:-2], obs[-2:].sum()), np.append(exp[:-2], exp[-2:].sum())
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1, len(picked)


def chi_square_critical(df: int) -> float:
    """The chi-square's 1e-6 upper critical value (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + 4.753 * (2 / (9 * df)) ** 0.5) ** 3
