"""The host's share of a served verifier step, stage by stage, on the CPU alone.

One ProposeColumns step of B states (bf16 hiddens [B, H], K drafts, the verdicts fused)
through every stage that runs on a host, each timed alone (median of --iters calls):
the client building and serializing the request, the server parsing it and reading it
into the engine's columns and Step, the server making and serializing the answer, the
client parsing it. No GPU and no network: what the wire's protobuf and the checks cost
per step on this machine's CPU, beside the served figures of bench_verifier.py. Writes
host_cost.json and host_cost.md to --out-dir.

    python bench/host_cost.py [--shapes 64x4096,16x4096,1x4096] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from results_file import write_results

from mtpdraft.client.messages import columns_request, parse_columns
from mtpdraft.service import wire
from mtpdraft.service.engine.columns import step as columns_step
from mtpdraft.service.engine.step import StepResult
from mtpdraft.v1 import drafter_pb2 as pb

VOCAB, K = 151680, 4


def timed_us(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def stages(batch: int, hidden: int, iters: int) -> dict[str, float]:
    hiddens = torch.randn(batch, hidden).to(torch.bfloat16)
    ids = np.arange(1, batch + 1, dtype=np.uint64)
    tokens, positions = np.ones(batch, np.int32), np.full(batch, 2048)
    verdicts = np.zeros(batch, np.int32)

    def build() -> pb.ColumnsRequest:
        return columns_request(ids, tokens, positions, hiddens, K, num_accepted=verdicts)

    request = build()
    data = request.SerializeToString()
    parsed = pb.ColumnsRequest.FromString(data)
    columns = wire.columns(parsed)
    result = StepResult(
        drafts=np.zeros((batch, K), np.int64),
        probs=np.full((batch, K), 0.5, np.float32),
        counts=np.full(batch, K),
        confidences=np.full(batch, 0.5),
        first_positions=positions.astype(np.int64),
        errors={},
    )
    answer = wire.columns_answer(1, result, {}).SerializeToString()
    out = {
        "client: build the request": timed_us(build, iters),
        "client: serialize it": timed_us(request.SerializeToString, iters),
        "server: parse it": timed_us(lambda: pb.ColumnsRequest.FromString(data), iters),
        "server: read the columns (wire.columns)": timed_us(lambda: wire.columns(parsed), iters),
        "server: check them into a Step": timed_us(
            lambda: columns_step(columns, hidden, VOCAB, max(batch, 1)), iters
        ),
        "server: the answer, made and serialized": timed_us(
            lambda: wire.columns_answer(1, result, {}).SerializeToString(), iters
        ),
        "client: parse the answer": timed_us(
            lambda: parse_columns(pb.ColumnsResponse.FromString(answer)), iters
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
        "median us per call, each stage alone.",
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
    args = parser.parse_args()
    report = {
        "command": "python " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu": cpu_name(),
        "shapes": {},
    }
    for shape in args.shapes.split(","):
        batch, hidden = (int(n) for n in shape.split("x"))
        report["shapes"][shape] = stages(batch, hidden, args.iters)
    write_results(args.out_dir, "host_cost", report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
