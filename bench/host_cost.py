"""The host's share of a served verifier step, stage by stage, on the CPU alone.

One ProposeBatch step of B states (bf16 hiddens [B, H], K drafts, the verdicts fused)
through every stage that runs on a host, each timed alone (median of --iters calls):
the client building and serializing the request, the server parsing it and reading it
into the engine's Step (its columns checked), the server making and serializing the answer, the
client parsing it. No GPU and no network: what the wire's protobuf and the checks cost
per step on this machine's CPU, beside the served figures of bench_verifier.py. Writes
host_cost.json and host_cost.md to --out-dir.

A served step runs each stage once every few milliseconds, after the chain's wait, not
hot in a loop: `--before idle` sleeps a chain's time (--idle-ms) before each timed call,
`--before busy` spins on the clock for that time instead (the core kept busy, no other
code run), `--before sweep` first reads a buffer larger than the last-level cache
(--sweep-mb), as other work between two steps would evict the stage's code and data;
written as host_cost_<before>.

    python bench/host_cost.py [--shapes 64x4096,16x4096,1x4096] [--before hot|idle|busy|sweep]
        [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from results_file import write_results

from mtpdraft.client.messages import batch_request, parse_batch
from mtpdraft.service import convert
from mtpdraft.service.engine.step import StepResult, StepShape
from mtpdraft.v1 import drafter_pb2 as pb

VOCAB, K = 151680, 4


def timed_us(fn, iters: int, before: Callable[[], object] = lambda: None) -> float:
    """The median of `iters` calls of `fn`, each after an untimed `before()`."""
    fn()
    times = []
    for _ in range(iters):
        before()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def stages(batch: int, hidden: int, iters: int, before: Callable[[], object]) -> dict[str, float]:
    hiddens = torch.randn(batch, hidden).to(torch.bfloat16)
    ids = np.arange(1, batch + 1, dtype=np.uint64)
    tokens, positions = np.ones(batch, np.int32), np.full(batch, 2048)
    verdicts = np.zeros(batch, np.int32)

    def build() -> pb.ProposeBatchRequest:
        return batch_request(ids, tokens, positions, hiddens, K, num_accepted=verdicts)

    request = build()
    data = request.SerializeToString()
    parsed = pb.ProposeBatchRequest.FromString(data)
    shape = StepShape(hidden, VOCAB, max(batch, 1))
    result = StepResult(
        drafts=np.zeros((batch, K), np.int64),
        probs=np.full((batch, K), 0.5, np.float32),
        counts=np.full(batch, K),
        confidences=np.full(batch, 0.5),
        first_positions=positions.astype(np.int64),
        errors={},
    )
    answer = convert.batch_answer(1, result, {}).SerializeToString()

    def timed(fn: Callable[[], object]) -> float:
        return timed_us(fn, iters, before)

    out = {
        "client: build the request": timed(build),
        "client: serialize it": timed(request.SerializeToString),
        "server: parse it": timed(lambda: pb.ProposeBatchRequest.FromString(data)),
        "server: read the columns into a Step (convert.batch)": timed(
            lambda: convert.batch(parsed, shape)
        ),
        "server: the answer, made and serialized": timed(
            lambda: convert.batch_answer(1, result, {}).SerializeToString()
        ),
        "client: parse the answer": timed(
            lambda: parse_batch(pb.ProposeBatchResponse.FromString(answer), ids)
        ),
    }
    out["all of them"] = sum(out.values())
    out["request bytes"] = len(data)
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(report: dict) -> str:
    shapes = list(report["shapes"])
    lines = [
        "# The host's share of a served step (bench/host_cost.py)",
        "",
        f"`{report['command']}` on {report['cpu']}, {report['date']}; bf16 hiddens, K = {K}; "
        "median us per call, each stage alone, each call after "
        f"{report.get('before', 'nothing')} (untimed).",
        "",
        "| stage | " + " | ".join(f"B x H = {s}" for s in shapes) + " |",
        "|---|" + "---|" * len(shapes),
    ]
    for stage in report["shapes"][shapes[0]]:
        cells = [report["shapes"][s][stage] for s in shapes]
        fmt = "{:,.0f}" if stage == "request bytes" else "{:,.1f}"
        lines.append(f"| {stage} | " + " | ".join(fmt.format(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x4096,16x4096,1x4096", help="B x H")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument(
        "--before",
        choices=["hot", "idle", "busy", "sweep"],
        default="hot",
        help="what precedes each timed call: nothing, a sleep, a busy wait, a pass over a "
        "large buffer",
    )
    parser.add_argument(
        "--idle-ms", type=float, default=3.5, help="--before idle's sleep, --before busy's wait"
    )
    parser.add_argument("--sweep-mb", type=int, default=256, help="--before sweep's buffer")
    args = parser.parse_args()
    sweep = np.ones(args.sweep_mb << 20, np.uint8) if args.before == "sweep" else None
    said, before = {  # (what precedes each call, as the report says it; the call)
        "hot": ("nothing", lambda: None),
        "idle": (f"a {args.idle_ms:g} ms sleep", lambda: time.sleep(args.idle_ms / 1e3)),
        "busy": (f"a {args.idle_ms:g} ms busy wait", lambda: _busy_wait(args.idle_ms / 1e3)),
        "sweep": (f"a pass over {args.sweep_mb} MB", lambda: sweep.sum()),
    }[args.before]
    report = {
        "command": "python " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu": cpu_name(),
        "before": said,
        "shapes": {},
    }
    for shape in args.shapes.split(","):
        batch, hidden = (int(n) for n in shape.split("x"))
        report["shapes"][shape] = stages(batch, hidden, args.iters, before)
    name = "host_cost" if args.before == "hot" else f"host_cost_{args.before}"
    write_results(args.out_dir, name, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
