"""Where a served verifier step goes: one verifier, B states, ProposeBatch, profiled.

Starts the server as the service's benches do (drafter_service.py), steps B states with ProposeBatch
(0 accepted each step) and, over the measured steps, samples the server with
py-spy (every thread, idle included, raw stacks) while the client times its
own phases (building the request, the round trip, reading the answer). Writes
the client's phases (profile.json) and the server's stacks (server.stacks) to
--out-dir; `--summarize DIR` prints where the server's threads spend their time.

    python bench/profile_served_step.py [--small] [--device cuda] [--batch 64] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from drafter_service import kv_blocks_for, serve_argv, start_server, write_model
from scratch import scratch_folder
from served_verifiers import CALL_TIMEOUT_S, BatchVerifier
from shapes import MIMO_7B, SMALL
from timing import log
from workload import Workload


async def steps(target: str, size: int, work: Workload, record_s: float, spy: list[str]):
    from mtpdraft.client import messages as m

    verifier = await BatchVerifier.start(target, size, work)
    phases = collections.defaultdict(list)
    recorder = None
    for index in range(work.warmup + work.steps):
        if index == work.warmup:
            recorder = subprocess.Popen(spy)
            await asyncio.sleep(0.5)  # py-spy attaches
        t0 = time.perf_counter()
        request = verifier.request(index)
        t1 = time.perf_counter()
        response = await verifier.client._stub.ProposeBatch(request, timeout=CALL_TIMEOUT_S)
        t2 = time.perf_counter()
        m.parse_batch(response, verifier.states)
        t3 = time.perf_counter()
        if recorder is not None:
            for name, value in (("build", t1 - t0), ("round_trip", t2 - t1), ("read", t3 - t2)):
                phases[name].append(value * 1e3)
    recorder.wait(timeout=record_s + 60)
    await verifier.close()
    return {name: statistics.median(v) for name, v in phases.items()}


def summarize(folder: Path, top: int = 25) -> str:
    """Per thread: the share of samples in each innermost service frame (and, where it
    differs, the innermost frame of all: the library call it is in)."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in (folder / "server.stacks").read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        own = [f for f in frames[1:] if "service/" in f] or [frames[-1]]
        where = own[-1] if own[-1] == frames[-1] else f"{own[-1]} > {frames[-1]}"
        counts[frames[0]][where] += int(n)
    out = []
    for thread, c in counts.items():
        total = sum(c.values())
        out.append(f"== {thread}: {total} samples")
        out += [f"{100 * n / total:5.1f}%  {k}" for k, n in c.most_common(top)]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out-dir", default="bench/results/profile")
    parser.add_argument("--summarize", metavar="DIR")
    args = parser.parse_args()
    if args.summarize:
        print(summarize(Path(args.summarize)))
        return 0

    shape = SMALL if args.small else MIMO_7B
    work = Workload(
        prompt=64 if args.small else 2048, num_drafts=4, warmup=20, steps=args.steps,
        hidden_size=shape["hidden_size"], vocab_size=shape["vocab_size"], dtype="bfloat16",
    )  # fmt: skip
    folder = scratch_folder("profile-served-step-")
    write_model(folder, shape)
    kv_blocks = kv_blocks_for(args.batch, work)
    server = start_server(serve_argv(Path(folder), args.device, kv_blocks, 4), tracing=False)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record_s = 6
    spy = [
        "py-spy", "record", "--pid", str(server.process.pid), "--format", "raw", "--idle",
        "--threads", "--nonblocking", "--rate", "500", "--duration", str(record_s),
        "--output", str(out / "server.stacks"),
    ]  # fmt: skip
    try:
        log("stepping")
        phases = asyncio.run(steps(server.target, args.batch, work, record_s, spy))
    finally:
        server.stop()
    report = {"command": "python " + " ".join(sys.argv), "batch": args.batch, "client_ms": phases}
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(summarize(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
