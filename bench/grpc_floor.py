"""The floor under the service's figures: what grpc.aio alone costs per stream message.

A server that answers each ProposeStream message with a canned reply (no parsing,
no scheduling, no engine) and clients that send pre-serialized requests: its
batch-1 round trip and its messages per second at many streams are the most any
Python grpc.aio service could reach on this machine. At batch 1 the server first
waits as long as the in-process step takes (blocking its loop, as a computing
engine would): both processes then idle between messages, and waking them costs
more than a back-to-back echo. bench_service.py reports these next to the
service's own figures. The reply is a ProposeBatchResponse of STATES rows (1 by
default: one state, a batch of one; more: a verifier's step, bench_verifier.py);
with TOGETHER > 1 the server waits for that many
messages (one per verifier), then answers them all one DELAY late (one batch a step,
as the service batches its verifiers); with UNIX it listens there too.

    python bench/grpc_floor.py --serve K DELAY_US [STATES [TOGETHER [UNIX]]]  # "PORT n"
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from client_processes import run_together
from server_process import ServerProcess, cpu_per_message
from timing import percentiles_us

SERVICE, METHOD = "mtpdraft.v1.Drafter", "ProposeStream"
START_TIMEOUT_S = 60.0


def _canned_reply(num_drafts: int, states: int = 0) -> bytes:
    """The answer to a batch of `states` states (0: one), num_drafts drafts each."""
    from mtpdraft.v1 import drafter_pb2 as pb

    states = max(states, 1)
    return pb.ProposeBatchResponse(
        request_id=1,
        width=num_drafts,
        drafts=list(range(num_drafts)) * states,
        probs=[0.5] * (num_drafts * states),
        draft_counts=[num_drafts] * states,
        confidences=[0.5] * states,
        first_positions=[2048] * states,
    ).SerializeToString()


def serve(
    num_drafts: int, delay_s: float, states: int = 0, together: int = 1, unix: str | None = None
) -> None:
    import grpc

    reply = _canned_reply(num_drafts, states)
    batch: list[asyncio.Future] = []  # the messages waiting for the rest of theirs

    async def answer(requests: Any, context: Any) -> Any:
        async for _ in requests:
            if together > 1:
                answered = asyncio.get_running_loop().create_future()
                batch.append(answered)
                if len(batch) == together:
                    time.sleep(delay_s)
                    for waiting in batch:
                        waiting.set_result(None)
                    batch.clear()
                await answered
            elif delay_s > 0:
                time.sleep(delay_s)
            yield reply

    async def main() -> None:
        handler = grpc.stream_stream_rpc_method_handler(answer)  # bytes in, bytes out
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        if unix:
            server.add_insecure_port(f"unix:{unix}")
        await server.start()
        print(f"PORT {port}", flush=True)
        await asyncio.to_thread(sys.stdin.read)  # the bench closes our stdin to stop us
        await server.stop(0)

    asyncio.run(main())


async def _streams(
    target: str, streams: int, request: bytes, steps: int, warmup: int, barrier: Any = None
) -> dict:
    """`streams` streams of one process: each warms up, then (after `barrier`, shared by
    the client processes) times `steps` round trips."""
    import grpc

    async with grpc.aio.insecure_channel(target) as channel:
        open_call = channel.stream_stream(f"/{SERVICE}/{METHOD}")
        calls = [open_call() for _ in range(streams)]
        times: list[float] = []

        async def run(call: Any, count: int, timed: list[float] | None) -> None:
            for _ in range(count):
                started = time.perf_counter()
                await call.write(request)
                await call.read()
                if timed is not None:
                    timed.append(time.perf_counter() - started)

        await asyncio.gather(*(run(call, warmup, None) for call in calls))
        # Processes start seconds apart: only the steps after all are warm are counted.
        if barrier is not None:
            await asyncio.to_thread(barrier.wait, START_TIMEOUT_S)
        started = time.monotonic()
        await asyncio.gather(*(run(call, steps, times) for call in calls))
        finished = time.monotonic()
        for call in calls:
            await call.done_writing()
        return {"times": times, "started": started, "finished": finished}


def measure(
    target: str, streams: int, processes: int, request: bytes, steps: int, warmup: int
) -> dict[str, Any]:
    """`streams` streams over `processes` client processes: p50 and messages per second
    over the measured steps, which every process starts together."""
    if processes <= 1:
        parts = [asyncio.run(_streams(target, streams, request, steps, warmup))]
    else:
        shares = [streams // processes + (i < streams % processes) for i in range(processes)]
        jobs = [(target, n, request, steps, warmup) for n in shares]
        parts = run_together(_streams, jobs, 600, "a floor client process")
    times = [t for p in parts for t in p["times"]]
    window = max(p["finished"] for p in parts) - min(p["started"] for p in parts)
    return {
        "streams": streams,
        "client_processes": max(processes, 1),
        **percentiles_us(times),
        "messages_per_s": streams * steps / window,
    }


def start_server(
    num_drafts: int, delay_s: float, states: int = 0, unix: str | None = None, together: int = 1
) -> ServerProcess:
    """The canned-reply server in a subprocess (see the module docstring)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(num_drafts)]
    cmd += [str(delay_s * 1e6), str(states), str(together), *([unix] if unix else [])]
    return ServerProcess(cmd, START_TIMEOUT_S)


def floor(
    request: bytes,
    num_drafts: int,
    step_s: float,
    batches: list[int],
    processes: Any,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """The batch-1 floor with each answer `step_s` late, then back-to-back at each
    count of streams (`processes(b)` client processes for b)."""
    out: dict[str, Any] = {}
    server = start_server(num_drafts, step_s)
    try:
        out["b1_after_step"] = measure(server.target, 1, 1, request, steps, warmup)
        out["b1_after_step"]["step_us"] = step_s * 1e6
    finally:
        server.stop()
    server = start_server(num_drafts, 0.0)
    try:
        out["streams"] = {}
        for b in batches:
            before, started = server.cpu_s(), time.monotonic()
            got = measure(server.target, b, processes(b), request, steps, warmup)
            after, window = server.cpu_s(), (started, time.monotonic())
            if before is not None and after is not None:
                spent = (after[0] - before[0], after[1] - before[1])
                got["server_cpu"] = cpu_per_message(spent, b * (steps + warmup), window)
            out["streams"][str(b)] = got
    finally:
        server.stop()
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        rest = sys.argv[4:]
        serve(
            int(sys.argv[2]),
            float(sys.argv[3]) * 1e-6,
            int(rest[0]) if rest else 0,
            int(rest[1]) if len(rest) > 1 else 1,
            rest[2] if len(rest) > 2 else None,
        )
