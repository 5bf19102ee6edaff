"""What sampled drafts cost: the captured chain of K drafts on the GPU, greedy against
sampled, and the in-process engine's step and its answer's bytes, in the MiMo-7B MTP
shape with random weights (bf16).

    python bench/bench_sampling.py [--batches 1,8,64] [--out bench/results]

Chain: every state drafts K in one replay of its bucket's graph (inputs staged before,
untimed); CUDA events around the replay, median of --iters. Greedy, then sampled at
temperature 0.7 with top_k = the support (64: q's most tokens), then at temperature 1.0
with top_p 0.95 and no top-k (the kept mass summed over the whole vocabulary). Engine:
the same B states step by step (verdict 0, so the rows keep their shape), engine.step's
wall time, and its ProposeBatchResponse's size as the server would send it.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_step import BLOCK, make_chain
from drafter_service import build_engine, engine_states, serve_argv, write_model
from results_file import write_results
from shapes import MIMO_7B, SMALL
from workload import Workload

from mtpdraft.service import convert
from mtpdraft.service.cli import limit_cpu_threads
from mtpdraft.service.engine.sampling import GREEDY, Sampling
from mtpdraft.service.engine.step import Step, single
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.decode_chain import ChainSampling
from mtpdraft.service.model.decode_graphs import DecodeGraphs
from mtpdraft.service.model.mtp_head import MTPHead

SUPPORT = 64
CONTEXT = 2048
KINDS = {  # name: (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    f"T 0.7, top_k {SUPPORT}": (0.7, SUPPORT, 1.0),
    "T 1.0, top_p 0.95": (1.0, 0, 0.95),
}


def chain_sampling(kind: tuple[float, int, float], b: int) -> ChainSampling | None:
    temperature, top_k, top_p = kind
    if temperature == 0:
        return None
    return ChainSampling(
        temperature=np.full(b, temperature), top_k=np.full(b, top_k), top_p=np.full(b, top_p),
        min_p=np.zeros(b), seeds=np.arange(b), states=np.arange(b), first_index=np.zeros(b),
        support=SUPPORT,
    )  # fmt: skip


def chain_ms(head: MTPHead, b: int, k: int, iters: int, gen: torch.Generator) -> dict:
    """Median ms of one K-draft chain's replay of each kind."""
    chain, blocks = make_chain(head, b, CONTEXT, gen)
    chain.limits = np.full(b, k)
    kv = head.new_kv_cache(blocks + b, BLOCK)
    kv.k.normal_()
    kv.v.normal_()
    graphs = DecodeGraphs(head, kv, b, k, buckets=(b,), masks=(False,), support=SUPPORT)
    out = {}
    for name, kind in KINDS.items():
        chain.sampling = chain_sampling(kind, b)
        assert graphs.fits(chain)
        for _ in range(3):
            graphs.stage(chain).replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]  # fmt: skip
        for start, end in events:
            graph = graphs.stage(chain)
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        out[name] = statistics.median(s.elapsed_time(e) for s, e in events)
    del graphs
    return out


def engine_step(engine, work: Workload, b: int, kind: tuple[float, int, float], steps: int):
    """(median engine.step ms, median answer bytes) of b states drafting as `kind` says."""
    temperature, top_k, top_p = kind
    sampling = Sampling(temperature, top_k, top_p, seed=1) if temperature else GREEDY
    states = engine_states(engine, b, work, seed=b)
    gen = torch.Generator().manual_seed(0)
    positions = [engine.states[s].next_position for s in states]
    times, sizes = [], []
    for step in range(work.warmup + steps):
        hiddens = torch.randn(b, work.hidden_size, generator=gen).to(torch.bfloat16)
        rows = [
            single(s, 7, hiddens[i], positions[i] + step, work.num_drafts,
                   previous=Verdict(0) if step else None,
                   sampling=sampling if step == 0 else None, shape=engine.step_shape)
            for i, s in enumerate(states)
        ]  # fmt: skip
        start = time.perf_counter()
        result = engine.step(Step.concat(rows))
        elapsed = time.perf_counter() - start
        assert not result.errors, result.errors
        if step >= work.warmup:
            times.append(elapsed * 1e3)
            sizes.append(convert.batch_answer(step, result, {}).ByteSize())
    for s in states:
        engine.free_state(s)
    return statistics.median(times), statistics.median(sizes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--num-drafts", type=int, default=4)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape = SMALL if args.small else MIMO_7B
    batches = [int(b) for b in args.batches.split(",")]
    k = args.num_drafts
    folder = Path(tempfile.mkdtemp())
    write_model(folder, shape)
    head = MTPHead(load_mtp_weights(folder), torch.device("cuda"), ops="triton")
    gen = torch.Generator().manual_seed(0)
    chains = {b: chain_ms(head, b, k, args.iters, gen) for b in batches}
    del head
    torch.cuda.empty_cache()
    work = Workload(CONTEXT, k, 5, args.steps, shape["hidden_size"], shape["vocab_size"],
                    "bfloat16")  # fmt: skip
    blocks = max(batches) * (-(-work.rows_per_state // BLOCK)) + 64
    start = time.perf_counter()
    engine, note = build_engine(serve_argv(folder, "cuda", blocks, k))
    build_s = time.perf_counter() - start  # graphs captured: every bucket, K and kind
    limit_cpu_threads()  # the engine's host work as `mtpdraft serve` runs it
    steps = {b: {name: engine_step(engine, work, b, kind, args.steps)
                 for name, kind in KINDS.items()} for b in batches}  # fmt: skip
    report = {
        "command": "python " + shlex.join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "shape": shape, "num_drafts": k, "context": CONTEXT, "support": SUPPORT,
        "engine_note": note, "engine_build_s": build_s,
        "rows": [{"batch": b, "kind": name, "chain_ms": chains[b][name],
                  "chain_vs_greedy": chains[b][name] / chains[b]["greedy"],
                  "step_ms": steps[b][name][0], "answer_bytes": steps[b][name][1],
                  "extra_answer_bytes": steps[b][name][1] - steps[b]["greedy"][1]}
                 for b in batches for name in KINDS],
    }  # fmt: skip
    text = markdown(report)
    print(text)
    if args.out:
        write_results(args.out, "sampling", report, text)
    return 0


def markdown(report: dict) -> str:
    lines = [
        f"# Sampled drafts' cost ({report['device']}, MiMo-7B MTP shape, bf16, "
        f"K = {report['num_drafts']}, {report['context']}-token contexts, q of at most "
        f"{report['support']} tokens)",
        "",
        f"`{report['command']}`. Chain: one replay of the captured K-draft chain (CUDA "
        "events, median). Step: the in-process engine.step (host included, median); "
        f"answer: its ProposeBatchResponse's bytes. The engine (its graphs captured for "
        f"every bucket, K and kind) was built in {report['engine_build_s']:.0f} s.",
        "",
        "| B | drafts | chain ms | vs greedy | engine step ms | answer bytes | extra bytes |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['batch']} | {r['kind']} | {r['chain_ms']:.3f} | {r['chain_vs_greedy']:.3f}x "
            f"| {r['step_ms']:.3f} | {r['answer_bytes']} | {r['extra_answer_bytes']} |"
            for r in report["rows"]
        ),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
