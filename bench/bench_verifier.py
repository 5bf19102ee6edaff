"""A verifier's whole step, served: V verifiers x S states, three ways, against the engine.

Each verifier steps its S states together, every step carrying the previous
step's verdicts (0 accepted: the same rows every step on both sides), as:
- `batch`: one ProposeBatch call a step (all S hiddens in one [S, H] tensor);
- `stream`: one message a step on a ProposeStream;
- `many`: one ProposeBatch call a step, built state by state (propose_many: the
  client stacks S states' arguments into the columns).
Verifiers are asyncio client processes (spawned), started together; a step's time
is the verifier's round trip. Measured in the same run, as references:
- the kernel-only chain: the K draft steps of B = V x S rows as one graph replay, with
  the host staging and the one wait (MTPHead.decode_chain), no engine around it;
- the in-process engine: one ProposeBatch step as the server computes it (the
  columns checked into a Step, then engine.step), B = V x S;
- the transport floor: a canned-reply grpc.aio server (grpc_floor.py) that answers the
  same request bytes one in-process step late, over TCP and a Unix socket; for V > 1,
  V verifier processes whose messages it answers together, one in-process step (of
  B = V x S) after the last arrives: what one batch a step allows with no server work;
- one verifier of S states over the server's Unix socket (--unix-socket);
- tracing on (a second server, with an SDK tracer and a no-op exporter) against off, at
  the largest shapes: stream on the two servers in turn, --rounds times, the
  median of each round's on/off ratio (one run of each moves by a few percent between
  runs: the verdict is taken from pairs measured back to back);
- the Go client (client/go's mtpdraft-hotpath -states S, built by make polyglot-go):
  V goroutines of one process, each a ProposeStream; skipped where not built.
Writes verifier.json and verifier.md to --out-dir, with each target's verdict. Only
ratios within one run count.

    python bench/bench_verifier.py [--small] [--device cuda|cpu] [--shapes 1x64,4x16,8x8,1x1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc_floor
from client_processes import run_together
from drafter_service import (
    build_engine,
    engine_states,
    kv_blocks_for,
    serve_argv,
    start_server,
    write_model,
)
from results_file import write_results
from scratch import scratch_folder
from served_verifiers import CALL_TIMEOUT_S, RUN_TIMEOUT_S, prefilled_states
from shapes import MIMO_7B, SMALL
from timing import log, percentiles_us
from workload import Workload, random_hiddens

MODES = ("batch", "stream", "many")


async def _verifier(target: str, mode: str, size: int, work: Workload, seed: int, barrier: Any):
    """One verifier: prefills `size` states, warms up, waits at the barrier, times its steps."""
    import numpy as np

    from mtpdraft.client import AsyncDrafterClient, ProposeArgs, Verdict

    rng = random.Random(seed)
    client = AsyncDrafterClient(target, timeout=CALL_TIMEOUT_S)
    await asyncio.wait_for(client.channel.channel_ready(), CALL_TIMEOUT_S)
    hiddens = random_hiddens(size, work, seed + 1)
    states: list[int] = []
    stream = None
    try:
        states = await prefilled_states(client, size, work, rng, seed)
        ids = np.array(states, dtype=np.uint64)
        token = np.full(size, rng.randrange(work.vocab_size), dtype=np.int32)
        if mode == "stream":
            stream = client.stream(timeout=None)

        async def step(index: int) -> int:
            position = work.prompt + index  # 0 accepted: the bonus token is the next one
            if mode == "many":
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
                got = await client.propose_many(requests)
            else:
                columns = (ids, token, np.full(size, position), hiddens, work.num_drafts)
                verdicts = np.zeros(size, dtype=np.int32) if index else None
                send = stream.step if stream is not None else client.propose_batch
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


def served(target: str, mode: str, verifiers: int, size: int, work: Workload) -> dict[str, Any]:
    """`verifiers` processes of `size` states each; drafts/s over the common window."""
    jobs = [(target, mode, size, work, 100 + i) for i in range(verifiers)]
    parts = run_together(_verifier, jobs, RUN_TIMEOUT_S, "a verifier")
    drafts = sum(p["drafts"] for p in parts)
    window = max(p["finished"] for p in parts) - min(p["started"] for p in parts)
    times = [t for p in parts for t in p["times"]]
    return {**percentiles_us(times), "drafts": drafts, "drafts_per_s": drafts / window}


def in_process(engine: Any, batch: int, work: Workload, seed: int) -> dict[str, Any]:
    """The engine alone on B = `batch` states: a ProposeBatch step as the server
    computes it (columns.step, then engine.step), and the kernel-only chain."""
    import numpy as np

    from mtpdraft.service.engine import columns
    from mtpdraft.service.model.decode_chain import ChainInputs

    k = work.num_drafts
    states = engine_states(engine, batch, work, seed)
    rows = random_hiddens(batch, work, seed + 1)
    token = random.Random(seed).randrange(work.vocab_size)
    times, drafts = [], 0
    for index in range(work.warmup + work.steps):
        started = time.perf_counter()
        step = columns.step(
            engine.step_shape,
            state_ids=states,
            tokens=[token] * batch,
            positions=[work.prompt + index] * batch,  # 0 accepted: the bonus token is next
            hiddens=rows,
            num_drafts=[k],
            num_accepted=[0] * batch if index else [],
        )
        result = engine.step(step)
        elapsed = time.perf_counter() - started  # the result is host arrays: synchronized
        assert not result.errors, result.errors
        if index >= work.warmup:
            times.append(elapsed)
            drafts += int(result.counts.sum())
    out = {"batch": batch, **percentiles_us(times), "drafts_per_s": drafts / sum(times)}
    # The kernels alone: the same states' K-step chain, its inputs already on the device.
    slots = np.array([engine.state(s).slot for s in states])
    chain = ChainInputs(
        tokens=np.full(batch, token, np.int64),
        hiddens=rows.to(engine.head.device),
        positions=np.full(batch, work.prompt, np.int64),
        limits=np.full(batch, k, np.int64),
        block_tables=engine.table.block_tables(slots),
    )
    chain_times = []
    for index in range(work.warmup + work.steps):
        started = time.perf_counter()
        engine.head.decode_chain(engine.kv, chain)  # host arrays out: synchronized
        if index >= work.warmup:
            chain_times.append(time.perf_counter() - started)
    kernels = percentiles_us(chain_times)
    out["kernel_only"] = {**kernels, "drafts_per_s": batch * k / (kernels["p50_us"] * 1e-6)}
    for state in states:
        engine.free_state(state)
    return out


def batch_request(size: int, work: Workload) -> bytes:
    """A verifier's step for `size` states as the wire carries it (the floor's payload)."""
    import numpy as np

    from mtpdraft.client.messages import batch_request as build

    hiddens = random_hiddens(size, work, 7)
    ids = np.arange(1, size + 1, dtype=np.uint64)
    msg = build(
        ids, np.ones(size, np.int32), np.full(size, work.prompt), hiddens, work.num_drafts,
        num_accepted=np.zeros(size, np.int32),
    )  # fmt: skip
    return msg.SerializeToString()


def late_floor(
    size: int, work: Workload, step_s: float, unix: str | None, verifiers: int = 1
) -> dict[str, Any]:
    """The canned-reply server answering `verifiers` verifiers' `size`-state steps
    together, `step_s` after the last of them arrives."""
    server = grpc_floor.start_server(
        work.num_drafts, step_s, states=size, unix=unix, together=verifiers
    )
    try:
        target = f"unix:{unix}" if unix else server.target
        request = batch_request(size, work)
        got = grpc_floor.measure(target, verifiers, verifiers, request, work.steps, work.warmup)
    finally:
        server.stop()
    drafts = got["messages_per_s"] * size * work.num_drafts
    over = got["p50_us"] - step_s * 1e6
    return {**got, "drafts_per_s": drafts, "step_us": step_s * 1e6, "over_step_us": over}


SOCKET_MODE = "stream, unix socket"
TRACED_MODE = "stream, tracing on (median round)"
GO_MODE = "stream, Go client"
GO_HOTPATH = "client/go/build/bin/mtpdraft-hotpath"


def tracing_rounds(
    off: str, on: str, verifiers: int, size: int, work: Workload, rounds: int
) -> dict[str, Any]:
    """stream on the tracing-off and tracing-on servers in turn, `rounds` times:
    the median round of tracing on, and the median of the rounds' on/off ratios."""
    pairs = []
    for _ in range(rounds):
        got_off = _served(off, "stream", verifiers, size, work)
        got_on = _served(on, "stream", verifiers, size, work)
        if "error" in got_off or "error" in got_on:
            return got_on if "error" in got_on else got_off
        pairs.append((got_off, got_on))
    ratios = [o["drafts_per_s"] / f["drafts_per_s"] for f, o in pairs]
    middle = sorted(range(rounds), key=lambda i: pairs[i][1]["drafts_per_s"])[rounds // 2]
    return {
        **pairs[middle][1],
        "median_on_off": statistics.median(ratios),
        "rounds": [
            {"off_drafts_per_s": f["drafts_per_s"], "on_drafts_per_s": o["drafts_per_s"]}
            for f, o in pairs
        ],
    }


def go_served(target: str, verifiers: int, size: int, work: Workload) -> dict[str, Any]:
    """`verifiers` Go verifiers of `size` states each (one process, a goroutine each)."""
    cmd = [GO_HOTPATH, "-address", target, "-streams", str(verifiers), "-states", str(size)]
    cmd += ["-prompt", str(work.prompt), "-num-drafts", str(work.num_drafts)]
    cmd += ["-warmup", str(work.warmup), "-steps", str(work.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(done.stderr.strip()[-300:])
    got = json.loads(done.stdout)
    return {key: got[key] for key in ("p50_us", "p90_us", "p99_us", "drafts", "drafts_per_s")}


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what it compares and whether it is met."""
    out: list[dict[str, Any]] = []

    def add(what: str, got: float | None, bound: float | None, at_most: bool) -> None:
        met = None if got is None or bound is None else (got <= bound if at_most else got >= bound)
        out.append({"target": what, "got": got, "bound": bound, "met": met})

    shapes = report["shapes"]
    largest = max(shapes.values(), key=lambda r: r["in_process"]["batch"])["in_process"]
    add(
        f"in-process drafts/s >= 0.8x the kernel-only chain's (B = {largest['batch']})",
        largest["drafts_per_s"] / largest["kernel_only"]["drafts_per_s"],
        0.8,
        False,
    )
    for key, row in shapes.items():
        engine, floor = row["in_process"], report["floor"].get(key, {})
        verifiers, size = (int(n) for n in key.split("x"))
        slack = 150.0 if size == 1 else 300.0
        if verifiers == 1:
            ways = (("stream", "tcp"), (GO_MODE, "tcp"), (SOCKET_MODE, "unix"))
            for mode, transport in ways:
                if mode not in row:
                    continue
                got, late = row.get(mode, {}).get("p50_us"), floor.get(transport)
                bound = late and engine["p50_us"] + late["over_step_us"] + slack
                add(f"{key} {mode}: p50 us <= in-process + floor + {slack:.0f}", got, bound, True)
        else:
            best = max((row.get(m, {}).get("drafts_per_s") or 0) for m in (*MODES, GO_MODE))
            add(f"{key}: drafts/s / in-process at B = {size * verifiers} >= 0.8", best
                / engine["drafts_per_s"], 0.8, False)  # fmt: skip
            if "tcp" in floor:  # the same ratio for a server that does no work at all
                add(
                    f"{key}: (reference) the canned-reply floor's drafts/s / in-process >= 0.8",
                    floor["tcp"]["drafts_per_s"] / engine["drafts_per_s"],
                    0.8,
                    False,
                )
        if TRACED_MODE in row:
            ratio = row[TRACED_MODE].get("median_on_off")
            rounds = len(row[TRACED_MODE].get("rounds", ()))
            add(f"{key} tracing on / off >= 0.97 (median of {rounds} rounds)", ratio, 0.97, False)
    return out


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value / 1e3:.2f}"


def markdown(report: dict[str, Any]) -> str:
    work = report["workload"]
    lines = [
        "# A verifier's step, served (bench/bench_verifier.py)",
        "",
        f"`{report['command']}` on {report['device']}, {report['date']}; "
        f"K = {work['num_drafts']}, prompt {work['prompt']} rows, {work['steps']} measured "
        "steps; asyncio client processes.",
        "",
        "| V x S | way | p50 step (ms) | drafts/s | x in-process |",
        "|---|---|---|---|---|",
    ]
    for shape, row in report["shapes"].items():
        engine = row["in_process"]
        kernels, b = engine["kernel_only"], engine["batch"]
        over = kernels["drafts_per_s"] / engine["drafts_per_s"]
        lines.append(
            f"| {shape} | kernel-only chain (B = {b}) | {_ms(kernels['p50_us'])} | "
            f"{kernels['drafts_per_s']:,.0f} | {over:.2f} |"
        )
        lines.append(
            f"| {shape} | in-process engine (B = {b}) | {_ms(engine['p50_us'])} | "
            f"{engine['drafts_per_s']:,.0f} | 1.00 |"
        )
        for transport, late in report["floor"].get(shape, {}).items():
            verifiers = int(shape.split("x")[0])
            answered = "answered together" if verifiers > 1 else "answered"
            ratio = late["drafts_per_s"] / engine["drafts_per_s"]
            lines.append(
                f"| {shape} | canned-reply floor, {transport}, {answered} one in-process step "
                f"late | {_ms(late['p50_us'])} (+{late['over_step_us']:.0f} us) | "
                f"{late['drafts_per_s']:,.0f} | {ratio:.2f} |"
            )
        for mode in (*MODES, GO_MODE, SOCKET_MODE, TRACED_MODE):
            got = row.get(mode)
            if got is None:
                continue
            if "error" in got:
                lines.append(f"| {shape} | {mode} | {got['error']} | | |")
                continue
            ratio = got["drafts_per_s"] / engine["drafts_per_s"]
            lines.append(
                f"| {shape} | {mode} | {_ms(got['p50_us'])} | {got['drafts_per_s']:,.0f} | "
                f"{ratio:.2f} |"
            )
    for shape, row in report["shapes"].items():
        got = row.get(TRACED_MODE, {})
        if got.get("rounds"):
            pairs = "; ".join(
                f"{r['off_drafts_per_s']:,.0f} / {r['on_drafts_per_s']:,.0f}" for r in got["rounds"]
            )
            lines += [
                "",
                f"{shape}, {TRACED_MODE.removesuffix(' (median round)')}: off / on drafts/s, "
                f"round by round: {pairs}; median on / off {got['median_on_off']:.2f}.",
            ]
    lines += ["", "| target | got | bound | met |", "|---|---|---|---|"]
    for t in report["targets"]:
        got = "" if t["got"] is None else f"{t['got']:,.2f}"
        bound = "" if t["bound"] is None else f"{t['bound']:,.2f}"
        met = {True: "yes", False: "no", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {got} | {bound} | {met} |")
    return "\n".join(lines) + "\n"


def _served(target: str, mode: str, verifiers: int, size: int, work: Workload) -> dict[str, Any]:
    log(f"{verifiers}x{size} {mode}")
    try:
        if mode == GO_MODE:
            return go_served(target, verifiers, size, work)
        return served(target, mode, verifiers, size, work)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--shapes", default="1x64,4x16,8x8,1x1", help="verifiers x states")
    parser.add_argument(
        "--ways",
        default=",".join((*MODES, "go", "unix", "tracing")),
        help="the served ways to measure: batch, stream, many; go, unix, tracing (each a stream)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="off/on pairs measured for tracing")
    parser.add_argument("--num-drafts", type=int, default=4)
    parser.add_argument("--prompt", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    args = parser.parse_args()

    import torch

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
    ways = set(args.ways.split(","))
    modes = [m for m in MODES if m in ways]
    if "go" in ways and Path(GO_HOTPATH).exists():
        modes.append(GO_MODE)
    largest = max(v * s for v, s in shapes)
    folder = scratch_folder("bench-verifier-")
    log("writing a random checkpoint")
    write_model(folder, shape)
    argv = serve_argv(Path(folder), args.device, kv_blocks_for(largest, work), work.num_drafts)
    report: dict[str, Any] = {
        "command": "python " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
        "workload": asdict(work),
        "server": argv,
        "shapes": {},
        "floor": {},
    }
    log("in-process engine and kernel-only chain")
    engine, _ = build_engine(argv)
    engines = {b: in_process(engine, b, work, seed=b) for b in sorted({v * s for v, s in shapes})}
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    sockets = scratch_folder("bench-verifier-sockets-")
    served_socket = f"{sockets}/drafter.sock"
    for verifiers, size in shapes:
        step_s = engines[verifiers * size]["p50_us"] * 1e-6
        log(f"{verifiers}x{size} canned-reply floor")
        floor = report["floor"][f"{verifiers}x{size}"] = {
            "tcp": late_floor(size, work, step_s, None, verifiers)
        }
        if verifiers == 1:
            floor["unix"] = late_floor(size, work, step_s, f"{sockets}/floor-{size}.sock")
    server = start_server([*argv, "--unix-socket", served_socket], tracing=False)
    traced = start_server(argv, tracing=True) if "tracing" in ways else None
    try:
        for verifiers, size in shapes:
            row: dict[str, Any] = {"in_process": engines[verifiers * size]}
            for mode in modes:
                row[mode] = _served(server.target, mode, verifiers, size, work)
            if verifiers == 1 and "unix" in ways:
                target = f"unix:{served_socket}"
                row[SOCKET_MODE] = _served(target, "stream", 1, size, work)
            if traced is not None and verifiers * size == largest:
                row[TRACED_MODE] = tracing_rounds(
                    server.target, traced.target, verifiers, size, work, args.rounds
                )
            report["shapes"][f"{verifiers}x{size}"] = row
    finally:
        server.stop()
        if traced is not None:
            traced.stop()
    report["targets"] = targets(report)
    write_results(args.out_dir, "verifier", report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
