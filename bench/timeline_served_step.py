"""Where one verifier's served step goes, hop by hop: a timeline from both processes.

The server runs as `mtpdraft serve` does, in a subprocess, with its hops stamped
(time.perf_counter_ns, the host's monotonic clock, which the client reads too):
the request's deserializer, the columns read, the queue, the engine's call (its
NaN/inf check, graph staging, the wait for the GPU; on the engine thread, or on
the loop's where no other verifier is due: --batches-on compares the two; on a CPU,
--chain-ms waits instead of computing each chain, as a GPU's chain is to the host), the
answer and its serializer. The chain's GPU time is read from CUDA events around
its replay. One verifier then steps B states, one ProposeBatchRequest a step (on a
ProposeStream, or unary ProposeBatch with --unary), stamping its own
phases. --awake keeps both processes' event loops polling instead of sleeping between
messages (the A/B of the serving threads kept awake; --awake server, the server's
alone). Each hop's median over the steps is written, with the command, to --out-dir as
timeline_<way>_<B>.json and .md.

    python bench/timeline_served_step.py [--small] [--device cuda] [--batch 64] [--unary]
        [--in-process] [--batches-on auto|engine-thread|loop] [--awake [server|both]]
        [--device cpu --chain-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import bisect
import functools
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from drafter_service import (
    SERVER_START_TIMEOUT_S,
    build_engine,
    engine_states,
    kv_blocks_for,
    serve_argv,
    serve_main,
    write_model,
)
from results_file import write_results
from scratch import scratch_folder
from served_verifiers import CALL_TIMEOUT_S, BatchVerifier
from server_process import ServerProcess
from shapes import MIMO_7B, SMALL
from timing import log
from workload import Workload, random_hiddens

STAMPS_ENV = "MTPDRAFT_TIMELINE_STAMPS"
BATCHES_ON_ENV = "MTPDRAFT_TIMELINE_BATCHES_ON"
CHAIN_MS_ENV = "MTPDRAFT_TIMELINE_CHAIN_MS"
AWAKE_ENV = "MTPDRAFT_TIMELINE_AWAKE"

# The hops of one served step in the order they happen: (label, from stamp, to stamp).
SERVER_HOPS = (
    ("client: build the request", "c_start", "c_built"),
    ("client -> server: serialize, send, receive", "c_built", "deser_start"),
    ("server: parse the message", "deser_start", "deser_end"),
    ("server loop: to the handler", "deser_end", "read_start"),
    ("server loop: read the columns", "read_start", "read_end"),
    ("server loop: check the columns", "read_end", "enqueued"),
    ("server loop: queue the step, to the batch", "enqueued", "batch_start"),
    ("server: to the engine (a thread hop, none inline)", "batch_start", "engine_start"),
    ("ENGINE", "engine_start", "engine_end"),
    ("server: back to the loop (a thread hop, none inline)", "engine_end", "loop_back"),
    ("server loop: to the answer", "loop_back", "answer_start"),
    ("server loop: build the answer", "answer_start", "answer_end"),
    ("server loop: to the serializer", "answer_end", "ser_start"),
    ("server: serialize the answer", "ser_start", "ser_end"),
    ("server -> client: send, receive, parse", "ser_end", "c_received"),
    ("client: read the answer", "c_received", "c_done"),
)
# The engine's step (engine.step), stamped from its calls: where the chain
# runs as a graph replay (CUDA), and as one hop elsewhere.
GRAPHED_ENGINE_HOPS = (
    ("engine: admit (the NaN/inf check where it cannot wait)", "engine_start", "admit_end"),
    ("engine: grow, the verdicts that recompute rows", "admit_end", "draft_start"),
    ("engine: plan the chain", "draft_start", "decode_start"),
    ("engine: the chain handed to its graph", "decode_start", "stage_start"),
    ("engine: stage the chain's inputs", "stage_start", "stage_end"),
    ("engine: launch the graph (the replay call)", "stage_end", "replay_end"),
    ("engine: NaN/inf check, bookkeeping, while the GPU drafts", "replay_end", "collect_start"),
    ("engine: wait for the GPU, copy the drafts back", "collect_start", "collect_end"),
    ("engine: the drafts, kept or cut, and last hiddens", "collect_end", "draft_end"),
    ("engine: record the proposals' drafts, the answer", "draft_end", "engine_end"),
)
ENGINE_HOPS = (
    *GRAPHED_ENGINE_HOPS[:3],
    ("engine: the chain (eager), the drafts kept or cut", "decode_start", "draft_end"),
    GRAPHED_ENGINE_HOPS[-1],
)


def hops(server: bool, graphed: bool) -> tuple[tuple[str, str, str], ...]:
    engine = GRAPHED_ENGINE_HOPS if graphed else ENGINE_HOPS
    if not server:
        return engine
    i = next(i for i, h in enumerate(SERVER_HOPS) if h[0] == "ENGINE")
    return (*SERVER_HOPS[:i], *engine, *SERVER_HOPS[i + 1 :])


# --- stamps ------------------------------------------------------------------------------


def install_stamps(stamps: list[tuple[str, int]], gpu_ms: list[float]) -> None:
    """Stamps the engine's step (and the server's hops, for a server built after this)
    into `stamps`; the chain's replay time on the GPU into `gpu_ms`."""
    import torch

    from mtpdraft.service import convert, servicer
    from mtpdraft.service.engine import admission, columns, engine
    from mtpdraft.service.model.decode_graphs import DecodeGraphs
    from mtpdraft.service.model.mtp_head import MTPHead
    from mtpdraft.service.serving.scheduler import ProposeScheduler

    now = time.perf_counter_ns

    def around(owner, name: str, before: str | None, after: str | None) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if before:
                stamps.append((before, now()))
            out = fn(*args, **kwargs)
            if after:
                stamps.append((after, now()))
            return out

        setattr(owner, name, wrapper)

    around(convert, "batch", "read_start", None)
    around(columns, "step", "read_end", None)  # convert.batch's check of the columns read
    around(convert, "batch_answer", "answer_start", "answer_end")
    around(ProposeScheduler, "enqueue", "enqueued", None)
    around(ProposeScheduler, "_answer", "loop_back", None)  # back on the loop, either way
    around(engine.DraftEngine, "step", "engine_start", "engine_end")
    around(engine, "admit", None, "admit_end")
    around(engine, "draft_with_grammars", "draft_start", "draft_end")
    around(MTPHead, "decode_chain", "decode_start", None)
    around(admission, "finite_rows", "finite_start", "finite_end")
    around(DecodeGraphs, "stage", "stage_start", "stage_end")
    around(DecodeGraphs, "collect", "collect_start", "collect_end")
    run = ProposeScheduler._run

    async def stamped_run(self, batch):
        stamps.append(("batch_start", now()))
        await run(self, batch)

    ProposeScheduler._run = stamped_run
    if torch.cuda.is_available():  # CUDA events around the replay (after the staged copies)
        events: list[Any] = []
        replay = torch.cuda.CUDAGraph.replay

        def timed_replay(self):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay(self)
            stamps.append(("replay_end", now()))
            end.record()
            events.append((start, end))

        torch.cuda.CUDAGraph.replay = timed_replay
        collect = DecodeGraphs.collect

        def timed_collect(self, chain):
            out = collect(self, chain)
            start, end = events.pop()
            gpu_ms.append(start.elapsed_time(end))
            return out

        DecodeGraphs.collect = timed_collect

    def stamped_handlers(make):
        def wrapped(behavior, request_deserializer, response_serializer):
            def deserialize(data):
                stamps.append(("deser_start", now()))
                msg = request_deserializer(data)
                stamps.append(("deser_end", now()))
                return msg

            def serialize(msg):
                stamps.append(("ser_start", now()))
                data = response_serializer(msg)
                stamps.append(("ser_end", now()))
                return data

            return make(behavior, deserialize, serialize)

        return wrapped

    for key, make in list(servicer._HANDLERS.items()):
        servicer._HANDLERS[key] = stamped_handlers(make)


def _batches_on(where: str) -> None:
    """Where a batch no other verifier is due for runs ("auto": where the server puts it,
    the loop's thread for a GPU engine; else every scheduler built from now on is set so)."""
    if where == "auto":
        return
    from mtpdraft.service.serving.scheduler import ProposeScheduler

    init = ProposeScheduler.__init__

    @functools.wraps(init)
    def placed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.inline = where == "loop"

    ProposeScheduler.__init__ = placed


def fake_chain(ms: float) -> None:
    """Every chain from now on is a wait of `ms` with the GIL free, as a GPU's replay is
    to the host, and outputs of the right shapes (drafts 0, probabilities 0.5): on a CPU
    the host's share of a step then shows in its total, not under an eager forward's."""
    import numpy as np
    import torch

    from mtpdraft.service.model.decode_chain import ChainOutputs
    from mtpdraft.service.model.mtp_head import MTPHead

    def waited(self, kv, chain, before_wait=None):
        start = time.perf_counter()
        steps, n = chain.steps, len(chain)
        hiddens = torch.zeros(steps, n, self.config.hidden_size, dtype=self.dtype)
        if before_wait is not None:  # the caller's work runs under the chain, as on a GPU
            before_wait(hiddens)
        time.sleep(max(0.0, ms / 1e3 - (time.perf_counter() - start)))
        return ChainOutputs(
            hiddens, np.zeros((steps, n), np.int64), np.full((steps, n), 0.5, np.float32)
        )

    MTPHead.decode_chain = waited


_pollers: set[asyncio.Task] = set()  # the running loops' polling tasks, held here


def keep_awake() -> None:
    """The running loop polls from now on instead of sleeping: a task that hands it
    back at once, forever (so the thread never blocks waiting for I/O)."""

    async def poll() -> None:
        while True:
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(poll())
    _pollers.add(task)
    task.add_done_callback(_pollers.discard)


def _awake_server() -> None:
    """Every ServingLoop started from now on keeps its event loop awake."""
    from mtpdraft.service.serving.loop import ServingLoop

    start = ServingLoop.start

    @functools.wraps(start)
    def started(self) -> None:
        start(self)
        keep_awake()

    ServingLoop.start = started


def _stamped_server(argv: list[str]) -> int:
    """serve_main with its hops stamped; the stamps go to $STAMPS_ENV at exit."""
    stamps: list[tuple[str, int]] = []
    gpu_ms: list[float] = []
    if CHAIN_MS_ENV in os.environ:  # first, so that the stamps wrap the waited chain
        fake_chain(float(os.environ[CHAIN_MS_ENV]))
    install_stamps(stamps, gpu_ms)
    _batches_on(os.environ.get(BATCHES_ON_ENV, "auto"))
    if AWAKE_ENV in os.environ:
        _awake_server()

    def dump() -> None:
        Path(os.environ[STAMPS_ENV]).write_text(json.dumps({"stamps": stamps, "gpu_ms": gpu_ms}))

    atexit.register(dump)
    return serve_main(argv, tracing=False)


# --- the verifier ------------------------------------------------------------------------


async def _steps(
    target: str, size: int, work: Workload, unary: bool, awake: bool
) -> list[dict[str, int]]:
    import grpc

    from mtpdraft.client import messages as m

    if awake:
        keep_awake()

    verifier = await BatchVerifier.start(target, size, work)
    stub = verifier.client._stub
    stream = None if unary else stub.ProposeStream()
    steps = []
    now = time.perf_counter_ns
    for index in range(work.warmup + work.steps):
        t: dict[str, int] = {"c_start": now()}
        request = verifier.request(index)
        request.request_id = index + 1
        t["c_built"] = now()
        if stream is None:
            response = await stub.ProposeBatch(request, timeout=CALL_TIMEOUT_S)
        else:
            await stream.write(request)
            response = await stream.read()
        t["c_received"] = now()
        got = m.parse_batch(response, verifier.states)
        t["c_done"] = now()
        assert not got.errors and int(got.counts.sum()), got.errors
        if index >= work.warmup:
            steps.append(t)
        await asyncio.sleep(0)
    if stream is not None:
        await stream.done_writing()
        assert await stream.read() == grpc.aio.EOF
    await verifier.close()
    return steps


def _in_process_steps(argv: list[str], size: int, work: Workload) -> dict[str, Any]:
    """The engine alone, stamped: B states stepped as the server steps them (columns.step,
    then engine.step), each step's window from before the first to after the second."""
    from mtpdraft.service.engine import columns

    stamps: list[tuple[str, int]] = []
    gpu_ms: list[float] = []
    install_stamps(stamps, gpu_ms)
    engine, _ = build_engine(argv)
    states = engine_states(engine, size, work, seed=size)
    hiddens = random_hiddens(size, work, 2)
    steps, now = [], time.perf_counter_ns
    for index in range(work.warmup + work.steps):
        t = {"c_start": now()}
        step = columns.step(
            engine.step_shape, state_ids=states, tokens=[7] * size,
            positions=[work.prompt + index] * size, hiddens=hiddens,
            num_drafts=[work.num_drafts], num_accepted=[0] * size if index else [],
        )  # fmt: skip
        result = engine.step(step)
        t["c_done"] = now()
        assert not result.errors and int(result.counts.sum()), result.errors
        if index >= work.warmup:
            steps.append(t)
    return {"steps": steps, "stamps": stamps, "gpu_ms": gpu_ms}


def timeline(steps: list[dict[str, int]], stamps: list[tuple[str, int]]) -> list[dict[str, int]]:
    """Each step's client stamps joined with the first stamp of each name inside the
    step's window."""
    stamps = sorted(stamps, key=lambda s: s[1])
    times = [t for _, t in stamps]

    out = []
    for step in steps:
        lo = bisect.bisect_left(times, step["c_start"])
        hi = bisect.bisect_right(times, step["c_done"])
        joined = dict(step)
        for name, at in stamps[lo:hi]:
            joined.setdefault(name, at)
        out.append(joined)
    return out


def _median_us(values: list[float]) -> float:
    return statistics.median(values) / 1e3 if values else float("nan")


def report(joined: list[dict[str, int]], gpu_ms: list[float], server: bool) -> dict[str, Any]:
    graphed = any("stage_start" in s for s in joined)
    rows = []
    for label, start, end in hops(server, graphed):
        spans = [s[end] - s[start] for s in joined if start in s and end in s]
        rows.append({"hop": label, "p50_us": _median_us(spans), "steps": len(spans)})
    finite = [s["finite_end"] - s["finite_start"] for s in joined if "finite_end" in s]
    total = [s["c_done"] - s["c_start"] for s in joined]
    return {
        "hops": rows,
        "step_p50_us": _median_us(total),
        "sum_of_hop_p50s_us": sum(h["p50_us"] for h in rows if not math.isnan(h["p50_us"])),
        "finite_check_p50_us": _median_us(finite),
        "gpu_chain_p50_us": statistics.median(gpu_ms[-len(joined) :]) * 1e3 if gpu_ms else None,
    }


def markdown(out: dict[str, Any]) -> str:
    r = out["report"]
    lines = [
        f"# {out['way']}: a step of {out['batch']} states, hop by hop",
        "",
        f"`{out['command']}` on {out['device']}, {out['date']}; K = "
        f"{out['workload']['num_drafts']}, {out['workload']['prompt']}-row prompts, "
        f"{out['workload']['steps']} measured steps. Each hop's p50 over the steps (the "
        "host's monotonic clock, read in every process).",
        "",
        "| hop | p50 (us) |",
        "|---|---|",
    ]
    lines += [f"| {h['hop']} | {h['p50_us']:.0f} |" for h in r["hops"]]
    lines += [
        "",
        f"Step p50 {r['step_p50_us']:.0f} us (the hops' p50s add up to "
        f"{r['sum_of_hop_p50s_us']:.0f}); the hiddens' NaN/inf check (while the GPU drafts "
        f"where the step allows) {r['finite_check_p50_us']:.0f} us.",
    ]
    if r["gpu_chain_p50_us"] is not None:
        gpu = r["gpu_chain_p50_us"]
        lines.append(f"The chain's replay on the GPU (CUDA events): {gpu:.0f} us.")
    return "\n".join(lines) + "\n"


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        return _stamped_server(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    way = parser.add_mutually_exclusive_group()
    way.add_argument("--unary", action="store_true", help="ProposeBatch, not the stream")
    way.add_argument("--in-process", action="store_true", help="the engine alone, no server")
    parser.add_argument(
        "--batches-on",
        choices=["auto", "engine-thread", "loop"],
        default="auto",
        help="where the server runs a batch no other verifier is due for (auto: the "
        "loop's thread on a GPU, the engine thread elsewhere)",
    )
    parser.add_argument(
        "--chain-ms",
        type=float,
        help="(CPU) each chain a wait of this long, as a GPU's is to the host, instead of "
        "the eager forward: the host's share of the step shows in its total",
    )
    parser.add_argument(
        "--awake",
        nargs="?",
        const="both",
        choices=["server", "both"],
        help="the server's and the verifier's event loops (server: the server's alone) poll "
        "instead of sleeping",
    )
    parser.add_argument("--out-dir", default="bench/results/profile")
    args = parser.parse_args()
    if args.awake and args.in_process:
        parser.error("--awake keeps a server's and a verifier's loops polling: not --in-process")
    if args.chain_ms is not None and args.device != "cpu":
        parser.error("--chain-ms stands in for a GPU's chain on the CPU: use --device cpu")

    import torch

    shape = SMALL if args.small else MIMO_7B
    work = Workload(
        prompt=64 if args.small else 2048, num_drafts=4, warmup=20, steps=args.steps,
        hidden_size=shape["hidden_size"], vocab_size=shape["vocab_size"], dtype="bfloat16",
    )  # fmt: skip
    folder = scratch_folder("timeline-")
    log("writing a random checkpoint")
    write_model(folder, shape)
    argv = serve_argv(Path(folder), args.device, kv_blocks_for(args.batch, work), work.num_drafts)
    log(f"stepping {args.batch} states")
    if args.in_process:
        if args.chain_ms is not None:
            fake_chain(args.chain_ms)
        got = _in_process_steps(argv, args.batch, work)
        way, name = "The in-process engine", "in_process"
    else:
        stamps_file = Path(folder) / "stamps.json"
        os.environ[STAMPS_ENV] = str(stamps_file)
        os.environ[BATCHES_ON_ENV] = args.batches_on
        if args.chain_ms is not None:
            os.environ[CHAIN_MS_ENV] = str(args.chain_ms)
        if args.awake:
            os.environ[AWAKE_ENV] = "1"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", *argv]
        server = ServerProcess(cmd, SERVER_START_TIMEOUT_S)
        try:
            both = args.awake == "both"
            steps = asyncio.run(_steps(server.target, args.batch, work, args.unary, both))
        finally:
            server.stop()
        got = {"steps": steps, **json.loads(stamps_file.read_text())}
        way = "One verifier, " + ("unary ProposeBatch" if args.unary else "ProposeStream")
        name = "unary" if args.unary else "stream"
        if args.batches_on != "auto":
            way += f", batches on the {args.batches_on.replace('-', ' ')}"
            name += "_" + args.batches_on.replace("-", "_")
        if args.awake:
            loops = "both event loops" if args.awake == "both" else "the server's event loop"
            way += f", {loops} kept awake (polling)"
            name += "_awake" if args.awake == "both" else "_awake_server"
    if args.chain_ms is not None:
        way += f", each chain a {args.chain_ms:g} ms wait"
        name += "_waited_chain"
    joined = timeline(got["steps"], [tuple(s) for s in got["stamps"]])
    out = {
        "command": "python " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
        "batch": args.batch,
        "way": way,
        "workload": {"num_drafts": work.num_drafts, "prompt": work.prompt, "steps": work.steps},
        "report": report(joined, got["gpu_ms"], server=not args.in_process),
    }
    write_results(args.out_dir, f"timeline_{name}_{args.batch}", out, markdown(out))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
