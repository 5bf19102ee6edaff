"""Shared pieces of the reliability tests: dedicated servers, accounting, probes.

Every reliability test runs its own `mtpdraft serve` (short state TTL, small
blocks) so that what one test leaves behind can never hide what another leaks.
The server's output is read continuously (a chatty server must never block on a
full pipe) and kept, so that a test can assert it logged no traceback.

No verdict may depend on the machine's speed: a state TTL is a multiple of the
measured time of the slowest step a test holds states across (`Pace`, measured as
each module starts), and every
wait polls for its condition with a bound that only a failure reaches (`PATIENCE`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import PATIENCE, ServerProcess, start_server

from mtpdraft.client import DrafterClient, FailedPrecondition
from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

H = 64  # hidden size of the test checkpoint (tests/drafting.py)
V = 200  # its vocabulary
BLOCK = 4  # rows per KV block on every reliability server

# The codes DESIGN.md ("Errors") and the proto document; any other (UNKNOWN, INTERNAL...) is a bug.
DOCUMENTED = frozenset({
    grpc.StatusCode.OK,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
})  # fmt: skip
DOCUMENTED_VALUES = frozenset(code.value[0] for code in DOCUMENTED)

# A lease outlasts the slowest step it must survive this many times over: room for
# the load to grow between the measurement and the test.
LEASE_FACTOR = 4.0


def server_args(ttl: float, **limits: object) -> list[str]:
    """`mtpdraft serve` options: small blocks, a short TTL, and any --limit overrides."""
    options = {
        "kv-blocks": 4096,
        "block-size": BLOCK,
        "max-drafts": 8,
        "max-batch": 8,
        "max-states": 64,
        "grace-period": 2,
        "state-ttl": ttl,
    }
    options |= {key.replace("_", "-"): value for key, value in limits.items()}
    return [item for key, value in options.items() for item in (f"--{key}", str(value))]


class ManagedServer:
    """`mtpdraft serve` in a subprocess whose output is drained into `lines`."""

    def __init__(self, model: Path, *args: str) -> None:
        self.model, self.args = model, args
        self.ttl = float(args[args.index("--state-ttl") + 1]) if "--state-ttl" in args else 600.0
        self.proc: ServerProcess = start_server(model, *args)
        self.address = self.proc.address
        self.port = int(self.address.rsplit(":", 1)[1])
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self._channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.DrafterStub(self._channel)

    def _drain(self) -> None:
        for line in self.proc.process.stdout:
            self.proc.lines.append(line)

    @property
    def pid(self) -> int:
        return self.proc.process.pid

    @property
    def log(self) -> str:
        return "".join(self.proc.lines)

    def alive(self) -> bool:
        return self.proc.process.poll() is None

    def info(self, timeout: float = PATIENCE) -> pb.GetInfoResponse:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=timeout)

    def health(self, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service=service)
        return stub.Check(request, timeout=PATIENCE).status

    def wait_exit(self, timeout: float) -> int:
        code = self.proc.process.wait(timeout)
        self._reader.join(10)
        self._channel.close()
        return code

    def stop(self, timeout: float = PATIENCE) -> int:
        code = self.proc.stop(timeout)
        self._reader.join(10)
        self._channel.close()
        return code

    def assert_no_traceback(self) -> None:
        log = self.log
        assert "Traceback" not in log and "Exception" not in log, log[-4000:]


def used_blocks(info: pb.GetInfoResponse) -> int:
    return info.kv_blocks_total - info.kv_blocks_free


def blocks_for(rows: int, block: int = BLOCK) -> int:
    return -(-rows // block)


def wait_until(
    predicate: Callable[[], bool], what: str = "condition", timeout: float = PATIENCE
) -> float:
    """Polls `predicate` every 50 ms; returns the seconds it took, fails after `timeout`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def wait_clean(server: ManagedServer, timeout: float | None = None) -> pb.GetInfoResponse:
    """Waits until the server holds no state, no handle and every block is free: by
    default for as long as a lease and PATIENCE (abandoned states go with their lease)."""
    timeout = server.ttl + PATIENCE if timeout is None else timeout
    last: list[pb.GetInfoResponse] = []

    def clean() -> bool:
        info = server.info()
        last[:] = [info]
        return (
            info.live_states == 0
            and info.kv_handles == 0
            and info.kv_blocks_free == info.kv_blocks_total
        )

    started = time.monotonic()
    while not clean():
        info = last[0]
        assert time.monotonic() - started < timeout, (
            f"not clean after {timeout:.1f} s: {info.live_states} states, {info.kv_handles} "
            f"handles, {used_blocks(info)} blocks used"
        )
        time.sleep(0.05)
    return last[0]


def assert_holds(
    server: ManagedServer, states: dict[int, int], handles: dict[int, int] | None = None
) -> None:
    """The server holds exactly these states (id -> rows) and handles (id -> rows), and the
    blocks in use are ceil(rows / block_size) for each of them."""
    handles = handles or {}
    info = server.info()
    expected = sum(blocks_for(r) for r in states.values()) + sum(
        blocks_for(r) for r in handles.values()
    )
    got = (info.live_states, info.kv_handles, used_blocks(info))
    assert got == (len(states), len(handles), expected), (
        f"(states, handles, blocks) = {got}, expected {(len(states), len(handles), expected)}"
    )


def rows_of(client: DrafterClient, state: int) -> int:
    """How many rows a state holds, read with TakeKV + InstallKV (which change nothing).

    A state left with a pending proposal by a call whose outcome the client never saw
    (cancelled, deadline) answers TakeKV with FAILED_PRECONDITION: the verdict 0 then
    settles it (keeping the proposal's row R0) and the count is read again. A Prefill
    stream cut short by the client is waited for until the server has ended it.
    """
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            handle = client.take_kv(state)
            break
        except FailedPrecondition as err:
            if err.reason == "PROPOSAL_PENDING":
                client.after_verify(state, 0)
                continue
            # A Prefill stream the client gave up on, not yet ended on the server.
            assert err.reason == "PREFILL_IN_PROGRESS", err
            assert time.monotonic() < deadline, "the Prefill stream never ended"
            time.sleep(0.02)
    client.install_kv(state, handle)
    return handle.num_rows


def hiddens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, H), dtype=np.float32)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed + 1_000_003).integers(0, V, n).tolist()


def prefilled(client: DrafterClient, rows: int, seed: int) -> int:
    state = client.alloc_state()
    if rows:
        client.prefill(state, tokens(rows, seed), hiddens(rows, seed), 1)
    return state


def tensor(array: np.ndarray) -> pb.Tensor:
    """An fp32 wire tensor."""
    array = np.ascontiguousarray(array, dtype="<f4")
    return pb.Tensor(dtype=pb.DTYPE_FP32, shape=list(array.shape), data=array.tobytes())


def propose_message(
    state: int, position: int, k: int, seed: int, *, previous: int | None = None
) -> pb.ProposeRequest:
    request = pb.ProposeRequest(
        state_id=state,
        token=tokens(1, seed)[0],
        hidden=tensor(hiddens(1, seed)[0]),
        position=position,
        num_drafts=k,
    )
    if previous is not None:
        request.previous.num_accepted = previous
    return request


def batch_message(*requests: pb.ProposeRequest, rid: int = 0) -> pb.ProposeBatchRequest:
    """The ProposeBatch (or ProposeStream message) of propose_message's requests, in order."""
    batch = pb.ProposeBatchRequest(
        request_id=rid,
        state_ids=[r.state_id for r in requests],
        tokens=[r.token for r in requests],
        positions=[r.position for r in requests],
        num_drafts=[r.num_drafts for r in requests],
        hiddens=pb.Tensor(
            dtype=pb.DTYPE_FP32,
            shape=[len(requests), H],
            data=b"".join(r.hidden.data for r in requests),
        ),
    )
    if any(r.HasField("previous") for r in requests):
        verdicts = [r.previous.num_accepted if r.HasField("previous") else -1 for r in requests]
        batch.num_accepted.extend(verdicts)
    return batch


def error_code(answer: pb.ProposeBatchResponse) -> int:
    """The code of a batch answer's error: the message's, else its first failed row's
    (0: every row drafted)."""
    if answer.HasField("error"):
        return answer.error.code
    return answer.errors[0].error.code if answer.errors else 0


def prefill_chunk(state: int, start: int, n: int, seed: int, total: int = 0) -> pb.PrefillChunk:
    """A chunk of n rows; `total` declares the rows of the whole stream (first chunk)."""
    return pb.PrefillChunk(
        state_id=state,
        start_position=start,
        tokens=tokens(n, seed),
        hiddens=tensor(hiddens(n, seed)),
        total_rows=total,
    )


class BusyEngine:
    """Keeps the server's engine thread busy for a while (`Pace.busy`, about 1 s on two
    loaded cores): three long Prefills (3000 rows each, 2250 blocks in all) on scratch
    states of their own, freed when done. Calls sent `lead` seconds after they were
    (`Pace.lead`) queue behind them."""

    ROWS, COPIES = 3000, 3

    def __init__(self, client: DrafterClient, lead: float = 0.0) -> None:
        self.client, self.lead = client, lead
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.COPIES)
        ]

    def _run(self, seed: int) -> None:
        state = self.client.alloc_state()
        try:
            self.client.prefill(state, tokens(self.ROWS, seed), hiddens(self.ROWS, seed), 1)
        finally:
            self.client.free_state(state)

    def __enter__(self) -> BusyEngine:
        for thread in self.threads:
            thread.start()
        time.sleep(self.lead)  # their rows are on the engine thread by now
        return self

    def __exit__(self, *exc: object) -> None:
        for thread in self.threads:
            thread.join(PATIENCE)
            assert not thread.is_alive(), "a BusyEngine Prefill never ended"

    def run(self) -> float:
        """Runs the Prefills to their end; returns the seconds they took."""
        started = time.monotonic()
        with self:
            pass
        return time.monotonic() - started


def fill_pool(client: DrafterClient, server: ManagedServer, leave: int) -> dict[int, int]:
    """Prefills scratch states until exactly `leave` blocks are free; returns them (id -> rows).

    100 blocks a state: a Prefill's time grows faster than its rows, so that 41 short
    ones fill the pool several times faster than five of 1020 blocks."""
    states = {}
    while (free := server.info().kv_blocks_free) > leave:
        rows = min(free - leave, 100) * BLOCK
        states[prefilled(client, rows, len(states))] = rows
    assert server.info().kv_blocks_free == leave
    return states


@dataclass(frozen=True)
class Pace:
    """How long the slow steps that tests hold states across take on this machine, now."""

    fill: float  # fill_pool from an empty pool
    busy: float  # a BusyEngine's Prefills

    def lease(self, least: float) -> float:
        """A state TTL that outlasts the slowest step LEASE_FACTOR times over."""
        return max(least, LEASE_FACTOR * max(self.fill, self.busy))

    @property
    def lead(self) -> float:
        """A short while into a BusyEngine: its Prefills reached the engine, far from done."""
        return self.busy / 8


def measure_pace(model: Path) -> Pace:
    """Times a BusyEngine and fill_pool on a server with the reliability servers' limits."""
    server = ManagedServer(model, *server_args(600.0))
    try:
        with DrafterClient(server.address, timeout=PATIENCE) as c:
            busy = BusyEngine(c).run()  # first: a new server's first Prefills are slower
            started = time.monotonic()
            fillers = fill_pool(c, server, leave=0)
            fill = time.monotonic() - started
            for state in fillers:
                c.free_state(state)
    finally:
        server.stop()
    return Pace(fill, busy)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RawStream:
    """A ProposeStream through the raw stub: answers by request id and the final status."""

    def __init__(self, stub: pb_grpc.DrafterStub, timeout: float | None = None) -> None:
        import queue

        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.answers: dict[int, pb.ProposeBatchResponse] = {}
        self.sent: list[int] = []
        self.code: grpc.StatusCode | None = None
        self._changed = threading.Condition()
        self.call = stub.ProposeStream(iter(self._requests.get, None), timeout=timeout)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        code = grpc.StatusCode.OK
        try:
            for resp in self.call:
                with self._changed:
                    self.answers[resp.request_id] = resp
                    self._changed.notify_all()
        except grpc.RpcError as err:
            code = err.code()
        with self._changed:
            self.code = code
            self._changed.notify_all()

    def send(self, request: pb.ProposeBatchRequest) -> int:
        self.sent.append(request.request_id)
        self._requests.put(request)
        return request.request_id

    def wait(self, request_id: int, timeout: float = PATIENCE) -> pb.ProposeBatchResponse | None:
        """The answer to `request_id`, or None if the stream ended without it."""
        with self._changed:
            self._changed.wait_for(
                lambda: request_id in self.answers or self.code is not None, timeout
            )
            return self.answers.get(request_id)

    def unanswered(self) -> list[int]:
        return [r for r in self.sent if r not in self.answers]

    def finish(self, timeout: float = PATIENCE) -> grpc.StatusCode:
        """Half-closes the stream and waits for its end; returns its status code."""
        self._requests.put(None)
        self._reader.join(timeout)
        assert self.code is not None, "the stream did not end"
        return self.code

    def cancel(self, timeout: float = PATIENCE) -> grpc.StatusCode:
        self.call.cancel()
        return self.finish(timeout)
