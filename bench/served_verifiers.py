"""Verifiers as the service's benches run them against a server: asyncio clients of
prefilled states stepping with each step's verdict (0 accepted), in one process or in
several started together (client_processes.py), and the Go client's hot path.

Kept free of torch at import: the client processes (spawned) import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from client_processes import run_together
from timing import percentiles_us
from workload import Workload, random_hiddens

CALL_TIMEOUT_S = 120.0
# A client process's whole run: connecting, prefilling, warm-up and measured steps.
RUN_TIMEOUT_S = 600.0


async def prefilled_states(
    client: Any, size: int, work: Workload, rng: random.Random, prompt_seed: int
) -> list[int]:
    """`size` new states on the server behind `client`, each prefilled with one prompt of
    work.prompt - 1 rows (random tokens from `rng`, hiddens from `prompt_seed`)."""
    prompt = random_hiddens(work.prompt - 1, work, prompt_seed)
    states = [await client.alloc_state() for _ in range(size)]
    tokens = [rng.randrange(work.vocab_size) for _ in range(work.prompt - 1)]
    await asyncio.gather(*(client.prefill(s, tokens, prompt, 1) for s in states))
    return states


class BatchVerifier:
    """One verifier of `size` prefilled states stepping them together, one
    ProposeBatchRequest a step, each step carrying the last one's verdicts (0 accepted)."""

    def __init__(self, client: Any, states: list[int], work: Workload) -> None:
        import numpy as np

        self.client, self.states, self.work = client, states, work
        self.ids = np.array(states, dtype=np.uint64)
        self.token = np.full(len(states), 7, dtype=np.int32)
        self.hiddens = random_hiddens(len(states), work, 2)

    @classmethod
    async def start(cls, target: str, size: int, work: Workload) -> BatchVerifier:
        from mtpdraft.client import AsyncDrafterClient

        client = AsyncDrafterClient(target, timeout=CALL_TIMEOUT_S)
        states = await prefilled_states(client, size, work, random.Random(0), prompt_seed=1)
        return cls(client, states, work)

    def request(self, index: int) -> Any:
        """Step `index`'s ProposeBatchRequest (the first carries no verdicts)."""
        import numpy as np

        from mtpdraft.client import messages as m

        size, work = len(self.states), self.work
        return m.batch_request(
            self.ids, self.token, np.full(size, work.prompt + index), self.hiddens,
            work.num_drafts, num_accepted=np.zeros(size, dtype=np.int32) if index else None,
        )  # fmt: skip

    async def close(self) -> None:
        for state in self.states:
            await self.client.free_state(state)
        await self.client.close()


@dataclass(frozen=True)
class ClientJob:
    """One client process's part: `states` states (one stream each in stream mode)."""

    target: str
    mode: str  # "stream" or "unary"
    states: int
    work: Workload
    seed: int


async def _client_run(job: ClientJob, barrier: Any = None) -> dict[str, Any]:
    """Prefills, warms up, waits at the barrier, then times every step of every state."""
    from mtpdraft.client import AsyncDrafterClient, Verdict

    work, rng = job.work, random.Random(job.seed)
    client = AsyncDrafterClient(job.target, timeout=CALL_TIMEOUT_S)
    await asyncio.wait_for(client.channel.channel_ready(), CALL_TIMEOUT_S)
    prompt = random_hiddens(work.prompt - 1, work, job.seed)
    rows = random_hiddens(job.states, work, job.seed + 1)
    states: list[int] = []
    streams = None
    try:
        for _ in range(job.states):
            states.append(await client.alloc_state())
        tokens = [rng.randrange(work.vocab_size) for _ in range(work.prompt - 1)]
        await asyncio.gather(*(client.prefill(s, tokens, prompt, 1) for s in states))
        if job.mode == "stream":
            streams = [client.stream(timeout=None) for _ in states]
        token = rng.randrange(work.vocab_size)
        times: list[float] = []
        drafts = 0

        async def run(i: int, first: int, count: int, record: bool) -> float:
            nonlocal drafts
            propose = streams[i].propose if streams is not None else client.propose
            for step in range(first, first + count):
                previous = Verdict(0) if step else None
                position = work.prompt + step  # 0 accepted: the bonus token is the next one
                started = time.perf_counter()
                proposal = await propose(
                    states[i], token, rows[i], position, work.num_drafts, previous=previous
                )
                if record:
                    times.append(time.perf_counter() - started)
                    drafts += len(proposal.tokens)
            return time.monotonic()

        await asyncio.gather(*(run(i, 0, work.warmup, False) for i in range(job.states)))
        if barrier is not None:  # every client process starts its measured steps together
            await asyncio.to_thread(barrier.wait, CALL_TIMEOUT_S)
        started = time.monotonic()
        ends = await asyncio.gather(
            *(run(i, work.warmup, work.steps, True) for i in range(job.states))
        )
        return {"times": times, "drafts": drafts, "started": started, "finished": max(ends)}
    finally:
        # Even after a failure: a state left behind would hold KV blocks that the
        # next measurement on this server needs.
        for stream in streams or ():
            with contextlib.suppress(Exception):
                await stream.close()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(client.free_state(s) for s in states))
        await client.close()


def go_client(binary: str, target: str, streams: int, work: Workload, seed: int) -> dict[str, Any]:
    """`streams` verifiers of the Go client (client/go's mtpdraft-hotpath), one process."""
    cmd = [
        binary, "-address", target, "-streams", str(streams), "-prompt", str(work.prompt),
        "-num-drafts", str(work.num_drafts), "-warmup", str(work.warmup),
        "-steps", str(work.steps), "-seed", str(seed),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CALL_TIMEOUT_S * 5)
    if done.returncode:
        raise RuntimeError(done.stderr.strip()[-500:] or f"exit status {done.returncode}")
    ended = time.monotonic()
    got = json.loads(done.stdout)
    # Its window ends when it has its last answer, a few ms before it exits (it frees its
    # states first): close enough to read the server's CPU over.
    return got | {"samples": got["steps"], "window": (ended - got["window_s"], ended)}


def over_grpc(
    target: str, mode: str, streams: int, work: Workload, processes: int, seed: int
) -> dict[str, Any]:
    """`streams` concurrent verifiers over `processes` client processes; drafts per second
    over the measured window (first measured step started to last one answered)."""
    if processes <= 1:
        parts = [asyncio.run(_client_run(ClientJob(target, mode, streams, work, seed)))]
    else:
        shares = [streams // processes + (i < streams % processes) for i in range(processes)]
        jobs = [(ClientJob(target, mode, n, work, seed + i),) for i, n in enumerate(shares)]
        parts = run_together(_client_run, jobs, RUN_TIMEOUT_S, "a client process")
    times = [t for p in parts for t in p["times"]]
    drafts = sum(p["drafts"] for p in parts)
    window = (min(p["started"] for p in parts), max(p["finished"] for p in parts))
    return {
        "mode": mode,
        "streams": streams,
        "client_processes": max(processes, 1),
        **percentiles_us(times),
        "drafts": drafts,
        "drafts_per_s": drafts / (window[1] - window[0]),
        "window": window,  # time.monotonic(), the same clock in every process
    }


def client_processes(streams: int, asked: int | None) -> int:
    """The asyncio client processes for `streams` streams: as asked (at most one a
    stream), or one up to 8 streams and beyond, up to 4 (a quarter of the cores): one
    asyncio client process tops out at a few thousand messages per second."""
    if asked is not None:
        return min(streams, asked)
    return 1 if streams <= 8 else max(1, min(4, (os.cpu_count() or 1) // 4))
