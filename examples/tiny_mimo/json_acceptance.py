"""Accepted drafts per verify step when the output must follow a JSON schema: drafts
constrained by the drafter's grammar against unconstrained drafts masked only at verify.

    python3 -m examples.tiny_mimo.json_acceptance --model DIR [--prompts 12] [--out FILE]

The target (this process, torch) decodes greedily under the schema: at each position its
logits are masked by a matcher of the verifier's own, moved on by the tokens it commits.
Each prompt is the first lines of a held-out json_data document; the output is the next
record, and decoding ends where the schema's object is complete. Per K (2, 3, 4) every
prompt is decoded twice with drafts from an in-process DraftEngine: from a state with
the schema as its grammar (every draft obeys it), and from a state without one (a draft
the schema forbids is rejected at verify, since the target's masked choice differs).
Both decodings must emit the same tokens (speculative decoding is lossless); the report
gives the mean drafts accepted per verify step and the tokens per target forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import xgrammar

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.step import single
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.grammar.spec import GrammarSpec
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead

from .json_data import HELD_OUT_SEED, SCHEMA, document
from .model import load_checkpoint
from .verify import Target


def allowed(matcher: xgrammar.GrammarMatcher, vocab: int) -> torch.Tensor:
    """[V] bool: what the verifier's grammar allows next (nothing once it is complete)."""
    words = xgrammar.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(words)
    return ((words[0, :, None] >> torch.arange(32)) & 1).flatten()[:vocab].bool()


def decode(model, engine, grammar, prompt: list[int], k: int, constrained: bool, most: int):
    """The target's masked greedy output after `prompt` and the drafts accepted per step."""
    vocab = model.config.vocab_size
    target = Target(model, len(prompt) + most + k + 2)
    hiddens, _ = target.forward(prompt)
    verifier = xgrammar.GrammarMatcher(grammar.compiled)
    logits = model.target_logits(hiddens[-1:].to(next(model.parameters()).dtype))[0]
    token = int(logits.masked_fill(~allowed(verifier, vocab), -torch.inf).argmax())
    assert verifier.accept_token(token)
    state = engine.alloc_state("", grammar=grammar if constrained else None)
    out, accepted = [token], []
    try:
        session = engine.begin_prefill(state, 1)
        session.append(prompt[1:], hiddens[:-1])
        session.finish()
        position, hidden, previous = len(prompt), hiddens[-1], None
        while len(out) < most and allowed(verifier, vocab).any():
            step = single(
                state, token, hidden, position, k, previous=previous, shape=engine.step_shape
            )
            drafts = engine.step(step).proposal(0, state).tokens
            hiddens, _ = target.forward([token, *drafts])
            logits = model.target_logits(hiddens.to(next(model.parameters()).dtype))
            a, walk = 0, verifier.fork()
            while a < len(drafts):
                choice = logits[a].masked_fill(~allowed(walk, vocab), -torch.inf).argmax()
                if int(choice) != drafts[a]:
                    break
                assert walk.accept_token(drafts[a])
                a += 1
            mask = allowed(walk, vocab)
            for d in drafts[:a]:
                assert verifier.accept_token(d)
            out += drafts[:a]
            accepted.append(a)
            if not mask.any():  # the object is complete after the accepted drafts
                break
            token = int(logits[a].masked_fill(~mask, -torch.inf).argmax())
            assert verifier.accept_token(token)
            out.append(token)
            target.truncate(position + a + 1)
            hidden, previous, position = hiddens[a], Verdict(a), position + a + 1
    finally:
        engine.free_state(state)
    return out[:most], accepted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="a checkpoint with its target")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--lines", type=int, default=3, help="records in each prompt")
    p.add_argument("--most", type=int, default=200, help="tokens decoded at most")
    p.add_argument("--out", type=Path, help="write the report (markdown) here")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    # fp64: verifying K + 1 tokens in one forward picks what one token a forward would.
    model = load_checkpoint(args.model, torch.float64).eval()
    head = MTPHead(load_mtp_weights(args.model), torch.device("cpu"), torch.float32)
    engine = DraftEngine(head, ServeConfig(model=str(args.model), kv_blocks=4096))
    grammar = engine.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    prompts = []
    for seed in range(HELD_OUT_SEED, HELD_OUT_SEED + args.prompts):
        lines = document(seed).split(b"\n")
        prompts.append(list(b"\n".join(lines[: args.lines]) + b"\n"))
    rows = []
    for k in (2, 3, 4):
        per_mode = {}
        outputs = {}
        for constrained in (True, False):
            accepted, outs = [], []
            for prompt in prompts:
                out, a = decode(model, engine, grammar, prompt, k, constrained, args.most)
                accepted += a
                outs.append(out)
            outputs[constrained] = outs
            per_mode[constrained] = (statistics.mean(accepted), len(accepted))
        assert outputs[True] == outputs[False], "speculative decoding changed the output"
        valid = sum(_parses(out) for out in outputs[True])
        rows.append((k, per_mode, valid))
        print(f"K={k}: {per_mode} ({valid}/{len(prompts)} outputs parse)", flush=True)
    text = "\n".join(
        [
            f"# Drafts accepted per verify step, JSON schema output ({args.model.name})",
            "",
            f"{args.prompts} held-out prompts of {args.lines} records; the target decodes the "
            "next record greedily under the schema. Constrained: the drafter's state has the "
            "schema as its grammar; unconstrained: no grammar, its drafts masked only at "
            "verify. Both emit the same tokens.",
            "",
            "| K | constrained: accepted / step | unconstrained: accepted / step | "
            "verify steps (constrained, unconstrained) |",
            "|---|---|---|---|",
            *(
                f"| {k} | {m[True][0]:.2f} | {m[False][0]:.2f} | {m[True][1]}, {m[False][1]} |"
                for k, m, _ in rows
            ),
            "",
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def _parses(tokens: list[int]) -> bool:
    try:
        json.loads(bytes(tokens).decode())
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
