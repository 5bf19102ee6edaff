"""Where the engine's host time goes in one ProposeBatch step, beside its chain.

Builds the engine as `mtpdraft serve` does on a small random MiMo checkpoint (torch's
intra-op threads limited as it limits them), prefills
B states, then profiles (cProfile) --steps steps of B rows, each checked into a Step
and drafted by engine.step, and prints the engine's and the chain's functions
by cumulative time: step's time less decode_chain's is the host work around
the kernels (the checks, the state table, the verdicts, the answer). On the CPU the
chain is torch's and slow, but the host work is the same code as on a GPU. With
--lines, line_profiler times each line of the functions named instead (by default the
chain's staging, replay and wait), and the process's threads are listed.

    python bench/profile_engine_host.py [--batch 64] [--steps 40] [--device cpu]
        [--lines [MODULE:QUALNAME ...]]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import pstats
import sys
import threading
import time
from pathlib import Path

import torch
from drafter_service import build_engine, engine_states, serve_argv
from scratch import scratch_folder
from shapes import MIMO_7B, SMALL
from workload import Workload, random_hiddens

from mtpdraft.service.cli import limit_cpu_threads
from mtpdraft.service.engine import columns
from mtpdraft.service.model.synthetic import write_random_checkpoint

STAGING = [
    f"mtpdraft.service.model.decode_graphs:{name}"
    for name in ("_Bucket.stage", "DecodeGraphs.stage", "DecodeGraphs.run", "DecodeGraphs.collect")
]


def named(spec: str):
    """The function MODULE:QUALNAME names."""
    module, qualname = spec.split(":")
    target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mimo", action="store_true", help="MiMo-7B's MTP shape, not a tiny one")
    parser.add_argument(
        "--lines",
        nargs="*",
        metavar="MODULE:QUALNAME",
        default=None,
        help="line-profile these (default: the chain's staging and wait)",
    )
    args = parser.parse_args()
    b, prompt = args.batch, args.prompt
    shape = MIMO_7B if args.mimo else SMALL
    folder = scratch_folder("profile-engine-")
    write_random_checkpoint(
        folder, "mimo", **shape, dtype=torch.bfloat16, seed=0,
        extra_config={"max_position_embeddings": 8192},
    )  # fmt: skip
    blocks = b * ((prompt + args.steps + 8) // 16 + 2)
    engine, _ = build_engine(serve_argv(Path(folder), args.device, blocks, 4))
    limit_cpu_threads()  # as `mtpdraft serve` does
    work = Workload(prompt, 4, 3, args.steps, shape["hidden_size"], shape["vocab_size"], "bfloat16")
    states = engine_states(engine, b, work, seed=1)
    rows = random_hiddens(b, work, 2)

    def step(index: int) -> None:
        engine.step(
            columns.step(
                engine.step_shape, state_ids=states, tokens=[5] * b,
                positions=[prompt + index] * b, hiddens=rows, num_drafts=[4],
                num_accepted=[0] * b if index else [],
            )
        )  # fmt: skip

    for index in range(3):
        step(index)
    if args.lines is not None:
        from line_profiler import LineProfiler

        lines = LineProfiler(*(named(spec) for spec in args.lines or STAGING))
        started = time.perf_counter()
        lines.runcall(lambda: [step(index) for index in range(3, 3 + args.steps)])
        per_step = (time.perf_counter() - started) / args.steps
        print(f"`python {' '.join(sys.argv)}`: B = {b}, {per_step * 1e3:.2f} ms a step")
        threads = [t.name for t in threading.enumerate()]
        print("threads:", threads, "torch's intra-op:", torch.get_num_threads())
        lines.print_stats(output_unit=1e-6)
        return 0
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    for index in range(3, 3 + args.steps):
        step(index)
    profile.disable()
    per_step = (time.perf_counter() - started) / args.steps
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).sort_stats("cumtime")
    stats.print_stats(r"service/(engine|model/(decode_chain|mtp_head))", 30)
    stats.sort_stats("tottime").print_stats(30)  # torch's and numpy's calls too
    print(f"`python {' '.join(sys.argv)}`: B = {b}, {args.device}, {per_step * 1e3:.2f} ms a step")
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
