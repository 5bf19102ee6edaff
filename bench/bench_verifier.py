"""A verifier's whole step, served: V verifiers x S states, three ways, against the engine.

Each verifier steps its S states together, every step carrying the previous
step's verdicts (0 accepted: the same rows every step on both sides), as:
- `columns`: one ProposeColumns call a step (all S hiddens in one [S, H] tensor);
- `columns-stream`: one message a step on a ProposeColumnsStream;
- `batch`: one ProposeBatch call a step (one ProposeRequest per state).
Verifiers are asyncio client processes (spawned), started together; a step's time
is the verifier's round trip. The in-process engine (engine.propose_batch at
B = V x S, as `mtpdraft serve` builds it) is the reference: served drafts/s over
in-process drafts/s, and the served p50 step over the in-process one. Writes
verifier.json and verifier.md to --out-dir. Only ratios within one run count.

    python bench/bench_verifier.py [--small] [--device cuda|cpu] [--shapes 1x64,4x16,8x8,1x1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import multiprocessing
import random
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_service import (
    BLOCK_SIZE,
    CALL_TIMEOUT_S,
    MAX_POSITIONS,
    SERVER_START_TIMEOUT_S,
    Workload,
    _hiddens,
    build_engine,
    in_process,
    log,
    percentiles_us,
    serve_argv,
    start_server,
)
from shapes import MIMO_7B, SMALL

MODES = ("columns", "columns-stream", "batch")


async def _verifier(target: str, mode: str, size: int, work: Workload, seed: int, barrier: Any):
    """One verifier: prefills `size` states, warms up, waits at the barrier, times its steps."""
    import numpy as np

    from mtpdraft.client import AsyncDrafterClient, ProposeArgs, Verdict

    rng = random.Random(seed)
    client = AsyncDrafterClient(target, timeout=CALL_TIMEOUT_S)
    await asyncio.wait_for(client.channel.channel_ready(), CALL_TIMEOUT_S)
    prompt = _hiddens(work.prompt - 1, work, seed)
    hiddens = _hiddens(size, work, seed + 1)
    states: list[int] = []
    stream = None
    try:
        states = [await client.alloc_state() for _ in range(size)]
        tokens = [rng.randrange(work.vocab_size) for _ in range(work.prompt - 1)]
        await asyncio.gather(*(client.prefill(s, tokens, prompt, 1) for s in states))
        ids = np.array(states, dtype=np.uint64)
        token = np.full(size, rng.randrange(work.vocab_size), dtype=np.int32)
        if mode == "columns-stream":
            stream = client.columns_stream(timeout=None)

        async def step(index: int) -> int:
            position = work.prompt + index  # 0 accepted: the bonus token is the next one
            if mode == "batch":
                requests = [
                    ProposeArgs(
                        state,
                        int(token[0]),
                        hiddens[i],
                        position,
                        work.num_drafts,
                        previous=Verdict(0) if index else None,
                    )
                    for i, state in enumerate(states)
                ]
                return sum(len(p.tokens) for p in await client.propose_batch(requests))
            columns = (ids, token, np.full(size, position), hiddens, work.num_drafts)
            verdicts = np.zeros(size, dtype=np.int32) if index else None
            send = stream.step if stream is not None else client.propose_columns
            got = await send(*columns, num_accepted=verdicts)
            assert not got.errors, got.errors
            return int(got.counts.sum())

        for index in range(work.warmup):
            await step(index)
        await asyncio.to_thread(barrier.wait, CALL_TIMEOUT_S)
        times, drafts, started = [], 0, time.monotonic()
        for index in range(work.warmup, work.warmup + work.steps):
            t0 = time.perf_counter()
            drafts += await step(index)
            times.append(time.perf_counter() - t0)
        return {"times": times, "drafts": drafts, "started": started, "finished": time.monotonic()}
    finally:
        if stream is not None:
            with contextlib.suppress(Exception):
                await stream.close()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(client.free_state(s) for s in states))
        await client.close()


def _verifier_process(args: tuple, barrier: Any, results: Any) -> None:
    try:
        results.put(asyncio.run(_verifier(*args, barrier)))
    except BaseException as exc:
        barrier.abort()
        results.put(f"{type(exc).__name__}: {exc}")
        raise


def served(target: str, mode: str, verifiers: int, size: int, work: Workload) -> dict[str, Any]:
    """`verifiers` processes of `size` states each; drafts/s over the common window."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(verifiers), ctx.Queue()
    procs = [
        ctx.Process(
            target=_verifier_process,
            args=((target, mode, size, work, 100 + i), barrier, results),
            daemon=True,
        )
        for i in range(verifiers)
    ]
    for p in procs:
        p.start()
    try:
        parts = [results.get(timeout=SERVER_START_TIMEOUT_S) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    failed = [p for p in parts if isinstance(p, str)]
    if failed:
        raise RuntimeError(f"a verifier failed: {failed[0]}")
    drafts = sum(p["drafts"] for p in parts)
    window = max(p["finished"] for p in parts) - min(p["started"] for p in parts)
    times = [t for p in parts for t in p["times"]]
    return {**percentiles_us(times), "drafts": drafts, "drafts_per_s": drafts / window}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# A verifier's step, served (bench/bench_verifier.py)",
        "",
        f"`{report['command']}` on {report['device']}, {report['date']}; "
        f"K = {report['workload']['num_drafts']}, prompt {report['workload']['prompt']} rows, "
        f"{report['workload']['steps']} measured steps.",
        "",
        "| V x S | way | p50 step (ms) | in-process p50 (ms) | drafts/s | x in-process |",
        "|---|---|---|---|---|---|",
    ]
    for shape, row in report["shapes"].items():
        engine = row["in_process"]
        lines.append(
            f"| {shape} | in-process engine (B = {engine['batch']}) | "
            f"{engine['p50_us'] / 1e3:.2f} | | {engine['drafts_per_s']:,.0f} | 1.00 |"
        )
        for mode in MODES:
            got = row.get(mode)
            if not got or "error" in got:
                lines.append(f"| {shape} | {mode} | {got and got.get('error')} | | | |")
                continue
            ratio = got["drafts_per_s"] / engine["drafts_per_s"]
            lines.append(
                f"| {shape} | {mode} | {got['p50_us'] / 1e3:.2f} | {engine['p50_us'] / 1e3:.2f} "
                f"| {got['drafts_per_s']:,.0f} | {ratio:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--shapes", default="1x64,4x16,8x8,1x1", help="verifiers x states")
    parser.add_argument("--num-drafts", type=int, default=4)
    parser.add_argument("--prompt", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    args = parser.parse_args()

    import torch

    from mtpdraft.service.model.synthetic import write_random_checkpoint

    shape = SMALL if args.small else MIMO_7B
    work = Workload(
        prompt=args.prompt or (64 if args.small else 2048),
        num_drafts=args.num_drafts,
        warmup=args.warmup if args.warmup is not None else (3 if args.small else 20),
        steps=args.steps or (10 if args.small else 200),
        hidden_size=shape["hidden_size"],
        vocab_size=shape["vocab_size"],
        dtype="bfloat16",
    )
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    largest = max(v * s for v, s in shapes)
    folder = tempfile.mkdtemp(prefix="bench-verifier-")
    log("writing a random checkpoint")
    write_random_checkpoint(
        folder, "mimo", **shape, dtype=torch.bfloat16, seed=0,
        extra_config={"max_position_embeddings": MAX_POSITIONS},
    )  # fmt: skip
    kv_blocks = largest * math.ceil(work.rows_per_state / BLOCK_SIZE) + 64
    argv = serve_argv(Path(folder), args.device, kv_blocks, work.num_drafts)
    report: dict[str, Any] = {
        "command": "python " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
        "workload": asdict(work),
        "server": argv,
        "shapes": {},
    }
    log("in-process engine")
    engine, _ = build_engine(argv)
    engines = {b: in_process(engine, b, work, seed=b) for b in sorted({v * s for v, s in shapes})}
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    server = start_server(argv, tracing=False)
    try:
        for verifiers, size in shapes:
            key = f"{verifiers}x{size}"
            row: dict[str, Any] = {"in_process": engines[verifiers * size]}
            for mode in MODES:
                log(f"{key} {mode}")
                try:
                    row[mode] = served(server.target, mode, verifiers, size, work)
                except Exception as exc:
                    row[mode] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            report["shapes"][key] = row
    finally:
        server.stop()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verifier.json").write_text(json.dumps(report, indent=1))
    (out / "verifier.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
