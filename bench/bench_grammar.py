"""What a grammar costs a draft: the in-process engine's step with every state under a
JSON schema against the same step with none, per draft, at B = 1, 8 and 64.

    python bench/bench_grammar.py [--shape mimo7b|small] [--device cuda] [--out bench/results]

The model is random (bench/shapes.py) and so is its tokenizer: the first 256 ids are the
bytes, the others random strings of 2 to 8 characters drawn from JSON's (letters, digits,
punctuation, spaces), written as a byte-level tokenizer.json, so that the grammar's masks
are filled over a vocabulary of the real size. Each step every state proposes K drafts
after a verdict of 0 whose next token is its last proposal's first draft (which its
grammar allows), so the rows stay the same shape step after step. Timed: engine.step
alone (the drafts come back to the host in it). Per draft: the step's time over the drafts
it returned; a grammar state whose grammar ends is replaced, outside the timing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from drafter_service import build_engine, serve_argv, write_model
from results_file import write_results
from shapes import MIMO_7B, SMALL
from timing import log
from workload import Workload, random_hiddens

sys.path.insert(0, str(Path(__file__).parents[1]))  # examples/: the byte table
from examples.tiny_mimo.tokenizer import byte_characters, byte_tokenizer
from mtpdraft.service.engine.step import Step, single
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.grammar.spec import GrammarSpec

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "score": {"type": "number"},
        },
        "required": ["name", "id", "tags", "score"],
    },
}
ALPHABET = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]":,. -_\n'


def write_tokenizer(folder: Path, vocab_size: int, seed: int = 0) -> None:
    """tokenizer.json: ids 0..255 the bytes, the rest distinct random strings."""
    rng, chars = random.Random(seed), byte_characters()
    spec = byte_tokenizer()
    vocab = spec["model"]["vocab"]
    while len(vocab) < vocab_size:
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 8)))
        vocab.setdefault("".join(chars[b] for b in text.encode()), len(vocab))
    (folder / "tokenizer.json").write_text(json.dumps(spec))


def run(engine, states, grammar, work: Workload, steps: int, seed: int) -> list[float]:
    """Seconds per draft of each timed step (after work.warmup untimed ones)."""
    b, shape = len(states), engine.step_shape
    gen = torch.Generator().manual_seed(seed)
    # The first Propose's token starts the output: the array's "[".
    tokens, positions = [ord("[")] * b, [engine.states[s].next_position for s in states]
    previous: list[Verdict | None] = [None] * b
    per_draft = []
    for step in range(work.warmup + steps):
        hiddens = torch.randn(b, work.hidden_size, generator=gen).to(torch.bfloat16)
        rows = [
            single(s, tokens[i], hiddens[i], positions[i], work.num_drafts,
                   previous=previous[i], shape=shape)
            for i, s in enumerate(states)
        ]  # fmt: skip
        batch = Step.concat(rows)
        start = time.perf_counter()
        result = engine.step(batch)
        elapsed = time.perf_counter() - start
        assert not result.errors, result.errors
        if step >= work.warmup:
            per_draft.append(elapsed / max(int(result.counts.sum()), 1))
        for i, s in enumerate(states):
            if result.counts[i] == 0:  # its grammar ended: a fresh state in its place
                engine.free_state(s)
                states[i] = fresh(engine, grammar, work, seed + step)
                tokens[i], previous[i] = ord("["), None
                positions[i] = engine.states[states[i]].next_position
                continue
            tokens[i] = int(result.drafts[i, 0])
            positions[i] += 1
            previous[i] = Verdict(0)
    return per_draft


def fresh(engine, grammar, work: Workload, seed: int) -> int:
    state = engine.alloc_state("", grammar=grammar)
    session = engine.begin_prefill(state, 1)
    session.append([7] * (work.prompt - 1), random_hiddens(work.prompt - 1, work, seed))
    session.finish()
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("mimo7b", "small"), default="mimo7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--num-drafts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape = MIMO_7B if args.shape == "mimo7b" else SMALL
    batches = [int(b) for b in args.batches.split(",")]
    work = Workload(64, args.num_drafts, 5, args.steps, shape["hidden_size"],
                    shape["vocab_size"], "bfloat16")  # fmt: skip
    folder = Path(tempfile.mkdtemp())
    write_model(folder, shape)
    write_tokenizer(folder, shape["vocab_size"])
    engine, note = build_engine(serve_argv(folder, args.device, 4096, args.num_drafts))
    if note:
        log(note)
    assert engine.grammars.compiler  # xgrammar imported, the tokenizer read: not timed
    start = time.perf_counter()
    grammar = engine.grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - start
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows = []
    for b in batches:
        timed = {}
        for name, g in (("none", None), ("json_schema", grammar)):
            states = [fresh(engine, g, work, i) for i in range(b)]
            seconds = run(engine, states, g, work, args.steps, seed=b)
            timed[name] = statistics.median(seconds) * 1e6
            for s in states:
                engine.free_state(s)
        rows.append({"batch": b, "per_draft_us": timed,
                     "overhead_us": timed["json_schema"] - timed["none"],
                     "ratio": timed["json_schema"] / timed["none"]})  # fmt: skip
        log(f"B={b}: {rows[-1]}")
    report = {"device": device, "shape": args.shape, "num_drafts": args.num_drafts,
              "vocab_size": shape["vocab_size"], "compile_s": compile_s, "rows": rows}  # fmt: skip
    lines = [
        f"# A grammar state's cost per draft ({device}, {args.shape} shape, bf16, "
        f"K = {args.num_drafts}, vocabulary {shape['vocab_size']})",
        "",
        f"JSON schema compiled in {compile_s:.2f} s. Median over {args.steps} steps of "
        "engine.step's time over the drafts it returned.",
        "",
        "| B | no grammar, us/draft | JSON schema, us/draft | overhead, us/draft | ratio |",
        "|---|---|---|---|---|",
        *(
            f"| {r['batch']} | {r['per_draft_us']['none']:.1f} | "
            f"{r['per_draft_us']['json_schema']:.1f} | {r['overhead_us']:.1f} | "
            f"{r['ratio']:.2f} |"
            for r in rows
        ),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(args.out, f"grammar_overhead_{args.shape}", report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
