"""`make bench-service`: what the gRPC service costs on top of the engine, in one run.

Measured in the MiMo-7B MTP shape with random weights (bf16), every state holding a
2048-row prompt, K drafts per step, and each step carrying the previous step's
verdict (0 accepted: the same rows every step, on both sides):

1. the in-process draft step at batch 1 (engine.step of one row), p50;
2. the batch-1 hot path over gRPC on loopback: ProposeStream (a batch of one a message)
   and unary Propose (previous=...), p50, against (1) (DESIGN.md, "Targets": the stream
   at most 150 us above);
3. 1, 8 and 64 concurrent streams (one state each) in drafts per second, against
   the in-process batched step (engine.step, a row a state) at the same batch sizes
   (DESIGN.md, "Targets": at least 0.8x at 64), with the server's mean batch and, read from
   /proc over the measured steps, its event loop's CPU per message, how busy the
   loop was and the other threads' CPU per message (the engine thread's included);
4. tracing on (an SDK TracerProvider with a no-op exporter in the server) against
   off (Telemetry()): (2) and (3) again. Skipped, with a note, when OpenTelemetry
   is not installed;
5. the floor (grpc_floor.py): a grpc.aio server answering the same request bytes
   with a canned reply, no work: the least any Python grpc.aio service could add,
   and its event loop's CPU per message; each batch-1 row of (2) also shows its
   overhead past this floor's answer one step late;
6. a Go verifier's view (--go-hotpath, client/go's mtpdraft-hotpath, built by
   `make polyglot-go`): (2) and (3) for the stream again, every stream a goroutine of
   one process, against each tracing-off server. A Go or C++ verifier engine spends
   far less per message than the asyncio client, so this is what the server adds;
7. with --repeats N, the most streams again on N - 1 more starts of the tracing-off
   server (Go client, or asyncio without it), and their median and range: the same
   code gave 16.3k and 21.6k drafts/s on two starts of one run.

The server runs in its own process (as a verifier would see it), built by the
`mtpdraft serve` code from the same checkpoint folder; the clients are the
package's asyncio client, spread over a few processes for many streams so that
the client is not what is measured. Both sides traverse the same contexts
(prompt + warm-up + measured steps), so only the transport and the batching
differ. Only ratios within this run are meaningful. Writes service.json and
service.md to --out-dir (bench/results by default; CPU smoke runs belong in /tmp).

    python bench/bench_service.py [--small] [--device cuda|cpu] [--out-dir DIR]
    python bench/bench_service.py --render DIR/service.json   # its markdown again
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

# Kept free of torch at import: client worker processes (spawned) re-import this
# file, and an fp32 client needs neither torch nor the service.
import grpc_floor
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
from served_verifiers import CALL_TIMEOUT_S, client_processes, go_client, over_grpc
from server_process import CpuTrace, ServerProcess, cpu_per_message
from shapes import MIMO_7B, SMALL
from timing import log, percentiles_us
from workload import Workload, random_hiddens

STREAM_OVERHEAD_TARGET_US = 150.0
STREAMS_RATIO_TARGET = 0.8


# --- in-process: the engine alone --------------------------------------------------------------


def in_process(engine: Any, batch: int, work: Workload, seed: int) -> dict[str, Any]:
    """engine.step over `batch` states, each its own Propose's row, timed per step after
    the warm-up."""
    from mtpdraft.service.engine.step import Step, single
    from mtpdraft.service.engine.types import Verdict

    states = engine_states(engine, batch, work, seed)
    rows = random_hiddens(batch, work, seed + 1)
    token = random.Random(seed).randrange(work.vocab_size)
    times, drafts = [], 0
    for step in range(work.warmup + work.steps):
        position = work.prompt + step  # 0 accepted: the bonus token is the next position
        started = time.perf_counter()
        requests = Step.concat(
            [
                single(
                    state, token, rows[i], position, work.num_drafts,
                    previous=Verdict(0) if step else None, shape=engine.step_shape,
                )
                for i, state in enumerate(states)
            ]
        )  # fmt: skip
        result = engine.step(requests)  # host arrays: synchronized
        elapsed = time.perf_counter() - started
        assert not result.errors, result.errors
        if step >= work.warmup:
            times.append(elapsed)
            drafts += int(result.counts.sum())
    for state in states:
        engine.free_state(state)
    return {
        "batch": batch,
        **percentiles_us(times),
        "drafts": drafts,
        "drafts_per_s": drafts / sum(times),
    }


# --- over gRPC ---------------------------------------------------------------------------------


def floor_suite(
    work: Workload, step_s: float, batches: list[int], procs: int | None
) -> dict[str, Any]:
    """The grpc.aio floor for the same request bytes, at batch 1 (answers `step_s` late)
    and at each stream count."""
    from mtpdraft.client import ProposeArgs, Verdict
    from mtpdraft.client import messages as m

    hidden = random_hiddens(1, work, seed=1)[0]
    one = ProposeArgs(1, 7, hidden, work.prompt, work.num_drafts, previous=Verdict(0))
    request = m.batch_request_of([one]).SerializeToString()
    return grpc_floor.floor(
        request,
        work.num_drafts,
        step_s,
        sorted({1, *batches}),
        lambda b: client_processes(b, procs),
        work.steps,
        work.warmup,
    )


def _attempt(what: str, notes: list[str], fn: Any, *args: Any) -> dict[str, Any]:
    """fn(*args), or {"error": ...} with a note: one failed measurement spoils no other."""
    try:
        return fn(*args)
    except Exception as exc:
        notes.append(f"{what} failed: {type(exc).__name__}: {exc}".replace("\n", " ")[:500])
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def with_server_stats(server: ServerProcess, fn: Any, *args: Any) -> dict[str, Any]:
    """fn(*args) (a result with "samples" messages timed in "window"), plus the server's
    batch-size histogram over it (warm-up included) and its CPU per message in the window."""
    from mtpdraft.client import DrafterClient
    from mtpdraft.client.loadtest.report import batch_histogram

    with DrafterClient(server.target, timeout=CALL_TIMEOUT_S) as client, CpuTrace(server) as cpu:
        before = client.info()
        result = fn(*args)
        result["server_batches"] = batch_histogram(before, client.info())
    spent = cpu.between(*result["window"])
    if spent is not None and result.get("samples"):
        result["server_cpu"] = cpu_per_message(spent, result["samples"], result["window"])
    return result


def grpc_suite(
    argv: list[str],
    tracing: bool,
    work: Workload,
    batches: list[int],
    procs: int | None,
    notes: list[str],
    go_hotpath: str | None = None,
) -> dict[str, Any]:
    """Batch-1 stream and unary, then each batch size in streams, against one server; then
    each batch size with the Go client (`go_hotpath`), if given."""
    name = "tracing on" if tracing else "tracing off"
    server = start_server(argv, tracing)
    try:
        target = server.target

        def measure(what: str, *args: Any) -> dict[str, Any]:
            return _attempt(f"{name}: {what}", notes, with_server_stats, server, over_grpc, *args)

        out: dict[str, Any] = {
            "stream_b1": measure("stream, batch 1", target, "stream", 1, work, 1, 10),
            "unary_b1": measure("unary, batch 1", target, "unary", 1, work, 1, 11),
            "streams": {},
        }
        for b in batches:
            p = client_processes(b, procs)
            if b == 1:  # one stream is the batch-1 hot path, measured above
                got = out["stream_b1"]
            else:
                got = measure(f"{b} streams", target, "stream", b, work, p, 20 + b)
            out["streams"][str(b)] = got
            log(f"  {b} streams: {got.get('drafts_per_s', 'failed')} drafts/s")
        if go_hotpath is not None:
            out["go"] = {}
            for b in sorted({1, *batches}):
                got = _attempt(
                    f"{name}: Go client, {b} streams", notes, with_server_stats, server,
                    go_client, go_hotpath, target, b, work, 40 + b,
                )  # fmt: skip
                out["go"][str(b)] = got
                log(f"  Go client, {b} streams: {got.get('drafts_per_s', 'failed')} drafts/s")
        return out
    finally:
        server.stop()


def repeat_suite(
    servers: dict[str, list[str]],
    first: dict[str, Any],
    streams: int,
    work: Workload,
    procs: int | None,
    notes: list[str],
    go_hotpath: str | None,
    repeats: int,
) -> dict[str, list[float]]:
    """`streams` streams on repeats - 1 more starts of each server (key -> argv), taking
    turns; each key's drafts per second, the first from its suite (`first`)."""
    client = "go" if go_hotpath is not None else "streams"
    out: dict[str, list[float]] = {}
    for key in servers:
        value = _get(first, key, client, str(streams), "drafts_per_s")
        out[key] = [] if value is None else [value]
    for rep in range(1, repeats):
        for key, argv in servers.items():
            what = f"{key}, {streams} streams, start {rep + 1}"
            got = _attempt(
                what, notes, _on_new_server, argv, go_hotpath, streams, work, procs, 60 + rep
            )
            if "drafts_per_s" in got:
                out[key].append(got["drafts_per_s"])
            log(f"  {what}: {got.get('drafts_per_s', 'failed')} drafts/s")
    return out


def _on_new_server(
    argv: list[str],
    go_hotpath: str | None,
    streams: int,
    work: Workload,
    procs: int | None,
    seed: int,
) -> dict[str, Any]:
    """`streams` streams (Go client, or asyncio without it) on a new server on ARGV."""
    server = start_server(argv, False)
    try:
        if go_hotpath is not None:
            return with_server_stats(
                server, go_client, go_hotpath, server.target, streams, work, seed
            )
        p = client_processes(streams, procs)
        return with_server_stats(server, over_grpc, server.target, "stream", streams, work, p, seed)
    finally:
        server.stop()


# --- the report --------------------------------------------------------------------------------


def _get(tree: dict[str, Any], *path: str) -> float | None:
    """tree[path...], or None where a measurement is missing or failed."""
    for key in path:
        if not isinstance(tree, dict) or "error" in tree or key not in tree:
            return None
        tree = tree[key]
    return tree if isinstance(tree, int | float) else None


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    """Every comparison DESIGN.md ("Targets") asks for, None where a side is missing."""
    inproc, grpc = report["in_process"], report["grpc"]
    b1 = _get(inproc, "batched", "1", "p50_us")
    out: dict[str, Any] = {}

    def over_b1(p50: float | None) -> float | None:
        return None if p50 is None or b1 is None else p50 - b1

    for mode in ("stream", "unary"):
        p50 = _get(grpc, "tracing_off", f"{mode}_b1", "p50_us")
        out[f"{mode}_b1_overhead_us"] = over_b1(p50)
        out[f"{mode}_b1_over_in_process"] = _over(p50, b1)
    sizes = list(inproc["batched"])

    def over_batched(suite: str, client: str) -> dict[str, float | None]:
        return {
            b: _over(
                _get(grpc, suite, client, b, "drafts_per_s"),
                _get(inproc, "batched", b, "drafts_per_s"),
            )
            for b in sizes
        }

    out["streams_over_batched"] = over_batched("tracing_off", "streams")
    out["go_stream_b1_overhead_us"] = over_b1(_get(grpc, "tracing_off", "go", "1", "p50_us"))
    out["go_streams_over_batched"] = over_batched("tracing_off", "go")
    overhead, ratio64 = out["stream_b1_overhead_us"], out["streams_over_batched"].get("64")
    out["meets"] = {
        "stream_b1_overhead": None if overhead is None else overhead <= STREAM_OVERHEAD_TARGET_US,
        "streams64": None if ratio64 is None else ratio64 >= STREAMS_RATIO_TARGET,
    }
    if "repeats" in report:
        b = str(report["repeats"]["streams"])
        engine = _get(inproc, "batched", b, "drafts_per_s")
        out["repeats"] = {}
        for key, values in report["repeats"]["drafts_per_s"].items():
            if values:
                median = statistics.median(values)
                out["repeats"][key] = {
                    "median": median,
                    "min": min(values),
                    "max": max(values),
                    "median_over_batched": _over(median, engine),
                }
    if "tracing_on" in grpc:
        on_off = {
            f"{mode}_b1_p50": _over(
                _get(grpc, "tracing_on", f"{mode}_b1", "p50_us"),
                _get(grpc, "tracing_off", f"{mode}_b1", "p50_us"),
            )
            for mode in ("stream", "unary")
        }
        for b in sizes:
            on_off[f"streams{b}_drafts_per_s"] = _over(
                _get(grpc, "tracing_on", "streams", b, "drafts_per_s"),
                _get(grpc, "tracing_off", "streams", b, "drafts_per_s"),
            )
        out["tracing_on_over_off"] = on_off
    return out


def _f(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _yes(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "no")


def _cpu_cells(measured: dict[str, Any]) -> str:
    """The server's event loop CPU per message, its busy share, the other threads' CPU."""
    cpu = measured.get("server_cpu", {})
    return (
        f"{_f(cpu.get('loop_us_per_message'), '.0f')} | {_f(cpu.get('loop_busy'), '.0%')} "
        f"| {_f(cpu.get('others_us_per_message'), '.0f')}"
    )


def markdown(report: dict[str, Any]) -> str:
    w, r, grpc = report["workload"], report["ratios"], report["grpc"]
    inproc = report["in_process"]["batched"]
    b1 = _get(inproc, "1", "p50_us")
    lines = [
        f"gRPC service against the in-process engine, {report['device']}, {w['dtype']}, "
        f"hidden {w['hidden_size']}, vocab {w['vocab_size']}, prompt {w['prompt']} rows, "
        f"K={w['num_drafts']}, {w['steps']} measured steps per state after {w['warmup']} "
        f"(0 accepted per step). torch {report['torch']}, grpcio {report['grpcio']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| batch 1 | p50 us | in-process p50 us | over in-process | target | met "
        "| over the canned-reply floor (asyncio client) |",
        "|---|---|---|---|---|---|---|",
    ]
    # What a canned-reply server answering one step late adds (the floor table below):
    # the part of a row's overhead that no Python grpc.aio service avoids on this host.
    late = _get(report.get("floor", {}), "b1_after_step", "p50_us")
    floor = None if late is None or b1 is None else late - b1

    def b1_row(label: str, p50: float | None, overhead: float | None, stream: bool) -> str:
        """A batch-1 row; a stream's has the target and whether it met it."""
        target, met = "", ""
        if stream:
            target = f"<= +{STREAM_OVERHEAD_TARGET_US:g} us"
            met = _yes(None if overhead is None else overhead <= STREAM_OVERHEAD_TARGET_US)
        above = None if overhead is None or floor is None else overhead - floor
        return (
            f"| {label} | {_f(p50, '.1f')} | {_f(b1, '.1f')} | {_f(overhead, '+.1f', ' us')} "
            f"({_f(_over(p50, b1), '.2f', 'x')}) | {target} | {met} "
            f"| {_f(above, '+.1f', ' us')} |"
        )

    for mode, label in (("stream", "ProposeStream"), ("unary", "unary Propose(previous)")):
        p50 = _get(grpc, "tracing_off", f"{mode}_b1", "p50_us")
        lines.append(b1_row(label, p50, r.get(f"{mode}_b1_overhead_us"), mode == "stream"))
    off = grpc.get("tracing_off", {})
    if "go" in off:
        p50 = _get(off, "go", "1", "p50_us")
        lines.append(b1_row("ProposeStream, Go client", p50, r["go_stream_b1_overhead_us"], True))
    lines += [
        "",
        "| concurrent streams | client | drafts/s over gRPC | in-process batched drafts/s | ratio "
        "| target | met | client processes | server's mean batch "
        "| server loop CPU us/message | loop busy | its other threads CPU us/message |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for client, key, ratios_key in (
        ("asyncio", "streams", "streams_over_batched"),
        ("Go", "go", "go_streams_over_batched"),
    ):
        if key not in off:
            continue
        ratio = r[ratios_key]
        for b in inproc:
            stream = off[key].get(b, {})
            target = f">= {STREAMS_RATIO_TARGET}x" if b == "64" else ""
            met = ""
            if b == "64":
                met = _yes(None if ratio.get(b) is None else ratio[b] >= STREAMS_RATIO_TARGET)
            lines.append(
                f"| {b} | {client} | {_f(_get(stream, 'drafts_per_s'), '.0f')} "
                f"| {_f(_get(inproc, b, 'drafts_per_s'), '.0f')} "
                f"| {_f(ratio.get(b), '.2f', 'x')} | {target} | {met} "
                f"| {stream.get('client_processes', 1)} "
                f"| {_f(_get(stream, 'server_batches', 'mean_batch'), '.1f')} "
                f"| {_cpu_cells(stream)} |"
            )
    floor = report.get("floor", {})
    if floor and "error" not in floor:
        after = floor["b1_after_step"]
        lines += [
            "",
            "| grpc.aio floor: canned replies, no work (grpc_floor.py) | p50 us "
            "| messages/s | service messages/s | server loop CPU us/message |",
            "|---|---|---|---|---|",
            f"| 1 stream, each answer one in-process step ({after['step_us']:.0f} us) late "
            f"| {after['p50_us']:.1f} (+{after['p50_us'] - after['step_us']:.1f} us) "
            f"| {after['messages_per_s']:.0f} | | |",
        ]
        for b, got in floor["streams"].items():
            stream = off.get("streams", {}).get(b, {})
            service = _get(stream, "drafts_per_s")
            service_rate = None if service is None else service / w["num_drafts"]
            lines.append(
                f"| {b} stream{'s' if b != '1' else ''} | {_f(_get(got, 'p50_us'), '.1f')} "
                f"| {_f(_get(got, 'messages_per_s'), '.0f')} | {_f(service_rate, '.0f')} "
                f"| {_f(_get(got, 'server_cpu', 'loop_us_per_message'), '.0f')} |"
            )
    if "repeats" in r:
        rep = report["repeats"]
        lines += [
            "",
            f"| {rep['streams']} streams, {rep['client']} client, on {rep['starts']} server "
            "starts | drafts/s each | median | range | median / in-process batched |",
            "|---|---|---|---|---|",
        ]
        for key, got in r["repeats"].items():
            each = ", ".join(f"{v:.0f}" for v in rep["drafts_per_s"][key])
            lines.append(
                f"| {key.replace('_', ' ')} | {each} | {got['median']:.0f} "
                f"| {got['min']:.0f} - {got['max']:.0f} "
                f"| {_f(got['median_over_batched'], '.2f', 'x')} |"
            )
    if "tracing_on_over_off" in r:
        lines += ["", "| tracing on / off (server spans, no-op exporter) | ratio |", "|---|---|"]
        lines += [f"| {k} | {_f(v, '.3f', 'x')} |" for k, v in r["tracing_on_over_off"].items()]
    lines += [""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


# --- main --------------------------------------------------------------------------------------


def _importable(module: str) -> str | None:
    """None if `module` imports, else why not."""
    try:
        __import__(module)
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU smoke test)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--model", help="an existing checkpoint folder (default: write one)")
    parser.add_argument("--num-drafts", type=int, default=4, help="K")
    parser.add_argument("--prompt", type=int, help="prompt rows per state (default 2048)")
    parser.add_argument("--steps", type=int, help="measured steps per state")
    parser.add_argument("--warmup", type=int, help="warm-up steps per state")
    parser.add_argument("--batches", default="1,8,64", help="concurrent streams to compare")
    parser.add_argument("--client-processes", type=int, help="default: 1 up to 8 streams, else 4")
    parser.add_argument(
        "--go-hotpath",
        default="client/go/build/bin/mtpdraft-hotpath",
        help="the Go client's hot-path binary (make polyglot-go), run against the "
        "tracing-off server; skipped with a note where it is missing",
    )
    parser.add_argument(
        "--serve-options",
        default="",
        help="more `mtpdraft serve` options for the engine and every server, e.g. "
        '"--batch-wait-us 0" (an A/B against the defaults)',
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="starts of the tracing-off server to measure the most streams on (median, "
        "range); 1: the suite's one measurement",
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="measure nothing: write the markdown of an earlier service.json next to it",
    )
    args = parser.parse_args()
    if args.render:
        report = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(report))
        return 0

    import torch

    if (args.prompt is not None and args.prompt < 2) or (args.steps is not None and args.steps < 1):
        parser.error("--prompt needs at least 2 rows and --steps at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but there is no CUDA device (use --device cpu)")
    shape = SMALL if args.small else MIMO_7B
    batches = [int(b) for b in args.batches.split(",")]
    steps = args.steps or (20 if args.small else 500)
    warmup = args.warmup if args.warmup is not None else (3 if args.small else 50)
    # The CPU's attention is slow at long contexts: a short prompt keeps --small quick.
    prompt = args.prompt or (64 if args.small else 2048)
    work = Workload(
        prompt=prompt, num_drafts=args.num_drafts, warmup=warmup, steps=steps,
        hidden_size=shape["hidden_size"], vocab_size=shape["vocab_size"], dtype="bfloat16",
    )  # fmt: skip
    notes: list[str] = []
    if args.device == "cpu":
        notes.append("CPU run: a smoke test of the bench, not figures to compare with DESIGN.")

    folder = args.model
    if folder is None:
        folder = scratch_folder("bench-service-", in_memory=True)
        log(f"writing a random {'small' if args.small else 'MiMo-7B'} checkpoint")
        write_model(folder, shape)
    if args.device == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()})"
    kv_blocks = kv_blocks_for(max(batches), work)
    argv = serve_argv(Path(folder), args.device, kv_blocks, work.num_drafts)
    argv += shlex.split(args.serve_options)
    report: dict[str, Any] = {
        "command": "python " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "device": device_name,
        "torch": torch.__version__,
        "grpcio": importlib.metadata.version("grpcio"),
        "cpus": os.cpu_count(),
        "shape": shape,
        "workload": asdict(work),
        "server": argv,
        "targets": {
            "stream_b1_overhead_us_max": STREAM_OVERHEAD_TARGET_US,
            "streams64_over_batched_min": STREAMS_RATIO_TARGET,
        },
        "notes": notes,
    }

    log("in-process engine")
    engine, note = build_engine(argv)
    if note:
        notes.append(note)
    batched = {str(b): in_process(engine, b, work, seed=b) for b in batches}
    if "1" not in batched:
        batched["1"] = in_process(engine, 1, work, seed=1)
    report["in_process"] = {"batched": batched}
    del engine  # the server processes get the device to themselves
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    report["grpc"] = {}
    server_missing = _importable("mtpdraft.service.server")
    if server_missing:
        notes.append(f"gRPC comparisons skipped: the server does not import ({server_missing})")
    else:
        go_hotpath = args.go_hotpath if Path(args.go_hotpath).is_file() else None
        if go_hotpath is None:
            notes.append(f"Go client skipped: no {args.go_hotpath} (make polyglot-go)")
        log("gRPC, tracing off")
        report["grpc"]["tracing_off"] = grpc_suite(
            argv, False, work, batches, args.client_processes, notes, go_hotpath
        )
        sdk_missing = _importable("opentelemetry.sdk.trace")
        if sdk_missing:
            notes.append(f"tracing comparison skipped: OpenTelemetry SDK missing ({sdk_missing})")
        else:
            log("gRPC, tracing on")
            report["grpc"]["tracing_on"] = grpc_suite(
                argv, True, work, batches, args.client_processes, notes
            )
        if args.repeats > 1:
            most = max(batches)
            servers = {"tracing_off": argv}
            log(f"gRPC, {most} streams on {args.repeats - 1} more starts of the server")
            report["repeats"] = {
                "streams": most,
                "client": "Go" if go_hotpath is not None else "asyncio",
                "starts": args.repeats,
                "drafts_per_s": repeat_suite(
                    servers, report["grpc"], most, work, args.client_processes, notes,
                    go_hotpath, args.repeats,
                ),
            }  # fmt: skip
        log("gRPC floor (canned replies)")
        step_s = (_get(batched, "1", "p50_us") or 0.0) * 1e-6
        report["floor"] = _attempt(
            "floor", notes, floor_suite, work, step_s, batches, args.client_processes
        )
    report["ratios"] = ratios(report)

    write_results(args.out_dir, "service", report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
