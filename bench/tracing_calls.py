"""Where tracing's cost goes per stream message: the server loop's Python calls, off and on.

A server on the CPU (a small random MiMo checkpoint, in this process, its event loop on
a thread of its own) serves --streams ProposeStreams of one state each (a batch of
one a message), --messages messages a stream; cProfile records the loop's thread
while they run, once with telemetry off and once with server spans through an SDK
TracerProvider to an exporter that drops them (the benches' traced server, drafter_service.py). Call
counts per message do not depend on the CPU's speed, unlike its time; the loop's own
calls (its wake-ups, callbacks) move with how the messages happened to batch, so the
table lists the calls made only with tracing on, per message. Writes tracing_calls.json
and .md to --out-dir.

    python bench/tracing_calls.py [--streams 16] [--messages 40] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import shlex
import sys
import threading
import time
from pathlib import Path

import torch
from drafter_service import traced_telemetry
from results_file import write_results
from scratch import scratch_folder

from mtpdraft.client import AsyncDrafterClient
from mtpdraft.client import messages as m
from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint
from mtpdraft.service.server import DrafterServer
from mtpdraft.service.telemetry import Telemetry

PROMPT, K = 8, 2


async def _streams(address: str, hidden: int, streams: int, messages: int, start) -> None:
    """Warms every stream up, calls `start()` on the server's loop, then measures."""
    client = AsyncDrafterClient(address, timeout=60)
    states = []
    for _ in range(streams):
        state = await client.alloc_state()
        await client.prefill(state, list(range(1, PROMPT + 1)), torch.randn(PROMPT, hidden), 1)
        states.append(state)

    async def stream(state: int, first: int, count: int) -> None:
        call = client._stub.ProposeStream()
        for k in range(count):
            position = PROMPT + 1 + first + k
            verdicts = [0] if first or k else None
            hiddens = torch.randn(1, hidden)
            await call.write(
                m.batch_request([state], [7], [position], hiddens, K, num_accepted=verdicts)
            )
            answer = await call.read()
            assert not answer.HasField("error") and list(answer.draft_counts) == [K], answer
        await call.done_writing()

    warmup = 5
    await asyncio.gather(*(stream(s, 0, warmup) for s in states))
    await start()
    await asyncio.gather(*(stream(s, warmup, messages) for s in states))
    await client.close()


async def calls_per_message(tracing: bool, streams: int, messages: int) -> dict[str, float]:
    """{function: calls per message} on the server loop's thread."""
    folder = write_random_checkpoint(scratch_folder("tracing-calls-"), "mimo", seed=1)
    head = MTPHead(load_mtp_weights(folder), torch.device("cpu"))
    engine = DraftEngine(head, ServeConfig(kv_blocks=4096, block_size=4, max_drafts=8))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    telemetry = traced_telemetry() if tracing else Telemetry()

    async def made():
        server = DrafterServer(engine, ServeConfig(port=0), telemetry)
        await server.start()
        return server, server.port

    server, port = asyncio.run_coroutine_threadsafe(made(), loop).result(60)
    profile = cProfile.Profile()

    def on_server(coroutine) -> asyncio.Future:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, loop))

    async def start() -> None:
        await on_server(_enable(profile))

    address, hidden = f"127.0.0.1:{port}", head.config.hidden_size
    await _streams(address, hidden, streams, messages, start)
    await on_server(_disable(profile))
    await on_server(server.drain(0))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(60)
    total = streams * messages
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return {
        f"{'/'.join(Path(file).parts[-2:])}:{line}:{name}": calls / total
        for (file, line, name), (_, calls, *_) in stats.items()
    }


async def _enable(profile: cProfile.Profile) -> None:
    profile.enable()


async def _disable(profile: cProfile.Profile) -> None:
    profile.disable()


def markdown(report: dict, rows: int = 30) -> str:
    off, on = report["off"], report["on"]
    added = sorted(((n, k) for k, n in on.items() if k not in off), reverse=True)
    lines = [
        "# Tracing's calls per stream message (bench/tracing_calls.py)",
        "",
        f"`{report['command']}`, {report['date']}: the server loop's Python calls per "
        f"message, {report['streams']} streams x {report['messages']} messages; "
        f"{sum(off.values()):.0f} with tracing off, {sum(on.values()):.0f} on.",
        "",
        f"Called only with tracing on: {sum(n for n, _ in added):.1f} calls per message.",
        "",
        "| function | calls per message |",
        "|---|---|",
    ]
    lines += [f"| `{key}` | {calls:.2f} |" for calls, key in added[:rows]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--messages", type=int, default=40, help="measured messages a stream")
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    report = {
        "command": "python " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "streams": args.streams,
        "messages": args.messages,
    }

    async def both() -> None:  # one client loop for both: grpc.aio keeps to its first
        report["off"] = await calls_per_message(False, args.streams, args.messages)
        report["on"] = await calls_per_message(True, args.streams, args.messages)

    asyncio.run(both())
    write_results(args.out_dir, "tracing_calls", report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
