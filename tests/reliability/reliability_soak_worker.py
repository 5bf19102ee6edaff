"""One soak worker process of test_reliability_soak: randomized verifier sessions.

Each session allocates one state (or 2 to 3 for a batched session), prefills it (in one
or more chunks), runs 1 to 5 verify steps (random K, acceptance, refeed, sometimes a
minimum confidence; unary, fused, streamed or batched), sometimes hands its KV over
(take, then install into a fresh state), and ends by freeing its states or abandoning
them to their lease (with or without a pending proposal, or as an uninstalled handle).
Some sessions meet a fault: a deadline too short for the call, a Prefill or a stream
cancelled mid-way, or a refused request.

The worker publishes an upper bound on what the server may hold for it (blocks, states,
handles) in a shared array, raised before each call and lowered after: the monitor in
the test process checks the server's GetInfo against the sum over workers. A state
whose last call was cut short (its outcome unknown) counts at its largest until freed.
It also publishes how many sessions it has run, for the monitor to see it progress.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import grpc
import numpy as np
from servers import PATIENCE

from mtpdraft.client import DrafterClient, DrafterError, ProposeArgs, Verdict
from mtpdraft.client import messages as m
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

H, V, BLOCK = 64, 200, 4
SLOTS = 7  # per worker: bound and peak of blocks, states, handles; sessions run
SESSIONS = 6  # the slot of the sessions run
CUT = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


def blocks_for(rows: int) -> int:
    return -(-rows // BLOCK)


class Ledger:
    """This worker's upper bound on the server's holdings, published for the monitor."""

    def __init__(self, index: int, shared, lock, ttl: float, slack: float) -> None:
        self.base, self.shared, self.lock, self.ttl = index * SLOTS, shared, lock, ttl
        self.slack = (
            slack  # an abandoned state counts this long past its lease (the reaper's delay)
        )
        self.states: dict[int, int] = {}  # id -> most rows it may hold
        self.handles: dict[int, int] = {}  # id -> rows
        self.abandoned: list[tuple[float, int, int, int]] = []  # until, blocks, states, handles

    def publish(self, blocks: int = 0, states: int = 0, handles: int = 0) -> None:
        now = time.monotonic()
        self.abandoned = [a for a in self.abandoned if a[0] > now]
        blocks += sum(map(blocks_for, self.states.values()))
        blocks += sum(map(blocks_for, self.handles.values()))
        blocks += sum(a[1] for a in self.abandoned)
        states += len(self.states) + sum(a[2] for a in self.abandoned)
        handles += len(self.handles) + sum(a[3] for a in self.abandoned)
        with self.lock:
            for i, value in enumerate((blocks, states, handles)):
                self.shared[self.base + 2 * i] = value
                self.shared[self.base + 2 * i + 1] = max(self.shared[self.base + 2 * i + 1], value)

    def abandon_state(self, state: int) -> None:
        rows = self.states.pop(state)
        self.abandoned.append((time.monotonic() + self.ttl + self.slack, blocks_for(rows), 1, 0))

    def abandon_handle(self, handle: int, taken_at: float) -> None:
        rows = self.handles.pop(handle)
        self.abandoned.append((taken_at + self.ttl + self.slack, blocks_for(rows), 0, 1))


@dataclass
class State:
    id: int
    rows: int = 0  # committed rows (a pending proposal's excluded)
    pending: tuple[int, int, int] | None = None  # (position, K, drafts) of the proposal


class Worker:
    def __init__(
        self, index: int, address: str, seed: int, shared, lock, ttl: float, slack: float
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.client = DrafterClient(address, timeout=PATIENCE)
        self.stub = pb_grpc.DrafterStub(self.client.channel)
        self.ledger = Ledger(index, shared, lock, ttl, slack)
        self.stats: Counter = Counter()
        self.errors: Counter = Counter()

    # ---- plumbing ----------------------------------------------------------------------

    def hid(self, n: int) -> np.ndarray:
        return self.rng.standard_normal((n, H), dtype=np.float32)

    def toks(self, n: int) -> list[int]:
        return self.rng.integers(0, V, n).tolist()

    def call(self, name: str, fn, *args, **kwargs):
        """One RPC: its result, or the DrafterError it raised (counted by code)."""
        self.stats["rpcs"] += 1
        self.stats[f"rpc.{name}"] += 1
        try:
            return fn(*args, **kwargs)
        except DrafterError as err:
            self.errors[err.code.name] += 1
            return err

    def raw(self, name: str, future) -> grpc.StatusCode:
        """A raw stub call's outcome (a future the session may have cancelled)."""
        self.stats["rpcs"] += 1
        self.stats[f"rpc.{name}"] += 1
        try:
            future.result()
            return grpc.StatusCode.OK
        except grpc.FutureCancelledError:
            code = grpc.StatusCode.CANCELLED
        except grpc.RpcError as err:
            code = err.code()
        self.errors[code.name] += 1
        return code

    def settle(self, state: State, err: DrafterError, before: int) -> bool:
        """After a refused call: False if the state is gone (its lease ran out)."""
        if err.code == grpc.StatusCode.NOT_FOUND and str(state.id) in err.details:
            self.ledger.states.pop(state.id, None)
            self.ledger.publish()
            self.stats["expired_under_us"] += 1
            return False
        assert err.code not in CUT, err
        self.ledger.states[state.id] = before  # a refused call changes nothing
        self.ledger.publish()
        return True

    def drop(self, state: State) -> None:
        """Frees a state whose last call was cut short (what it holds is unknown)."""
        self.call("FreeState", self.client.free_state, state.id)
        self.ledger.states.pop(state.id, None)
        self.ledger.publish()

    # ---- steps -------------------------------------------------------------------------

    def alloc(self) -> State | None:
        self.ledger.publish(states=1)
        result = self.call("AllocState", self.client.alloc_state)
        if isinstance(result, DrafterError):
            self.ledger.publish()
            return None
        self.ledger.states[result] = 0
        self.ledger.publish()
        return State(result)

    def prefill(self, state: State, n: int) -> bool:
        before = self.ledger.states[state.id]
        self.ledger.states[state.id] = state.rows + n
        self.ledger.publish()
        chunk_bytes = int(self.rng.choice([4096, 16384, 1 << 20]))
        result = self.call(
            "Prefill",
            self.client.prefill,
            state.id,
            self.toks(n),
            self.hid(n),
            state.rows + 1,
            chunk_bytes=chunk_bytes,
        )
        if isinstance(result, DrafterError):
            return self.settle(state, result, before)
        state.rows = result.num_rows
        self.ledger.states[state.id] = state.rows
        self.ledger.publish()
        return True

    def _verdict(self, state: State) -> Verdict | None:
        if state.pending is None:
            return None
        a = int(self.rng.integers(0, state.pending[2] + 1))
        refeed = self.hid(a) if a and self.rng.random() < 0.5 else None
        return Verdict(a, refeed)

    def _next(self, state: State, verdict: Verdict | None) -> int:
        """The position of the next Propose after `verdict` on the pending proposal."""
        if state.pending is None:
            return state.rows + 1
        return state.pending[0] + verdict.num_accepted + 1

    def _proposed(self, state: State, position: int, k: int, proposal) -> None:
        state.rows = position - 1
        state.pending = (position, k, len(proposal.tokens))
        self.ledger.states[state.id] = position - 1 + k
        self.stats["drafts"] += len(proposal.tokens)

    def step(self, states: list[State], mode: str, stream) -> list[State]:
        """One verify step for every state; returns the states still usable."""
        k = int(self.rng.integers(1, 9))
        tau = 0.3 if self.rng.random() < 0.1 else 0.0
        plans = []
        for s in states:
            verdict = self._verdict(s) if mode != "separate" else None
            if mode == "separate" and s.pending is not None:
                a = int(self.rng.integers(0, s.pending[2] + 1))
                before = self.ledger.states[s.id]
                self.ledger.states[s.id] = max(before, s.pending[0] + a)
                self.ledger.publish()
                result = self.call("AfterVerify", self.client.after_verify, s.id, a)
                if isinstance(result, DrafterError):
                    if not self.settle(s, result, before):
                        continue
                else:
                    s.rows, s.pending = result.num_rows, None
                    self.ledger.states[s.id] = s.rows
            position = self._next(s, verdict)
            plans.append((s, verdict, position, self.ledger.states[s.id]))
            self.ledger.states[s.id] = max(self.ledger.states[s.id], position - 1 + k)
        self.ledger.publish()
        if not plans:
            return []
        x, h = self.toks(len(plans)), self.hid(len(plans))
        if mode == "batch":
            args = [
                ProposeArgs(s.id, x[i], h[i], p, k, min_confidence=tau, previous=v)
                for i, (s, v, p, _) in enumerate(plans)
            ]
            result = self.call("ProposeBatch", self.client.propose_many, args)
            if isinstance(result, DrafterError):
                results = [result] * len(plans)
            else:  # each row its proposal, or its error (counted by code)
                self.errors.update(e.code.name for e in result.errors.values())
                results = [result.errors.get(i) or result.proposal(i) for i in range(len(plans))]
        else:
            results = []
            for i, (s, v, p, _) in enumerate(plans):
                propose = stream.propose if mode == "stream" else self.client.propose
                if mode == "stream":
                    self.stats["stream_messages"] += 1
                results.append(
                    self.call(
                        "ProposeStream" if mode == "stream" else "Propose",
                        propose,
                        s.id,
                        x[i],
                        h[i],
                        p,
                        k,
                        min_confidence=tau,
                        previous=v,
                    )
                )
        alive = []
        for (s, _, p, before), result in zip(plans, results, strict=True):
            if isinstance(result, DrafterError):
                if self.settle(s, result, before):
                    alive.append(s)
                continue
            self._proposed(s, p, k, result)
            alive.append(s)
        self.ledger.publish()
        return alive

    def settle_pending(self, state: State) -> bool:
        """AfterVerify on the pending proposal, if any; False if the state is gone."""
        if state.pending is None:
            return True
        a = int(self.rng.integers(0, state.pending[2] + 1))
        before = self.ledger.states[state.id]
        self.ledger.states[state.id] = max(before, state.pending[0] + a)
        self.ledger.publish()
        result = self.call("AfterVerify", self.client.after_verify, state.id, a)
        if isinstance(result, DrafterError):
            return self.settle(state, result, before)
        state.rows, state.pending = result.num_rows, None
        self.ledger.states[state.id] = state.rows
        self.ledger.publish()
        return True

    def hand_over(self, state: State) -> State | None:
        """TakeKV from a settled state, install into a fresh one, free the old one."""
        if not self.settle_pending(state):
            return None
        if state.pending is not None:
            return state
        self.ledger.publish(blocks=blocks_for(state.rows), handles=1)
        handle = self.call("TakeKV", self.client.take_kv, state.id)
        if isinstance(handle, DrafterError):
            return state if self.settle(state, handle, state.rows) else None
        self.ledger.handles[handle.handle_id] = handle.num_rows
        self.ledger.states[state.id] = 0
        self.ledger.publish()
        fresh = self.alloc()
        self.call("FreeState", self.client.free_state, state.id)
        self.ledger.states.pop(state.id)
        if fresh is None:
            self.ledger.abandon_handle(handle.handle_id, time.monotonic())
            self.ledger.publish()
            return None
        self.ledger.states[fresh.id] = handle.num_rows
        self.ledger.publish()
        result = self.call("InstallKV", self.client.install_kv, fresh.id, handle)
        if isinstance(result, DrafterError):
            self.ledger.handles.pop(handle.handle_id)
            self.drop(fresh)
            return None
        del self.ledger.handles[handle.handle_id]
        fresh.rows = result.num_rows
        self.ledger.states[fresh.id] = fresh.rows
        self.ledger.publish()
        self.stats["hand_overs"] += 1
        return fresh

    # ---- faults ------------------------------------------------------------------------

    def fault(self, state: State) -> bool:
        """A call cut short or refused; returns whether the state is still usable."""
        kind = self.rng.choice(["deadline", "prefill_cancel", "stream_cancel", "refused"])
        self.stats[f"fault.{kind}"] += 1
        if kind == "refused":  # a position that does not continue the state
            before = self.ledger.states[state.id]
            position = self._next(state, Verdict(0)) + 3
            result = self.call(
                "Propose", self.client.propose, state.id, 1, self.hid(1)[0], position, 2
            )
            assert isinstance(result, DrafterError), "a bad position was accepted"
            return self.settle(state, result, before)
        k = int(self.rng.integers(1, 9))
        verdict = Verdict(0) if state.pending is not None else None
        position = self._next(state, verdict)
        self.ledger.states[state.id] = max(self.ledger.states[state.id], position + 64 + k)
        self.ledger.publish()
        if kind == "deadline":
            request = m.propose_request(state.id, 1, self.hid(1)[0], position, k, previous=verdict)
            timeout = float(self.rng.uniform(0.0005, 0.02))
            self.raw("Propose", self.stub.Propose.future(request, timeout=timeout))
        elif kind == "prefill_cancel":
            rows, gap = int(self.rng.integers(2, 64)), float(self.rng.uniform(0, 0.01))
            start = state.rows + 1 if state.pending is None else -1  # pending: refused
            first = list(m.prefill_chunks(state.id, self.toks(rows), self.hid(rows), start))
            second = list(m.prefill_chunks(state.id, self.toks(1), self.hid(1), start))

            def chunks():  # runs on grpc's thread: no use of self.rng here
                yield from first
                time.sleep(gap)
                yield from second

            future = self.stub.Prefill.future(chunks(), timeout=PATIENCE)
            time.sleep(float(self.rng.uniform(0, 0.01)))
            future.cancel()
            self.raw("Prefill", future)
        else:
            args = ProposeArgs(state.id, 1, self.hid(1)[0], position, k, previous=verdict)
            call = self.stub.ProposeStream(iter([m.batch_request_of([args])]), timeout=PATIENCE)
            time.sleep(float(self.rng.uniform(0, 0.01)))
            call.cancel()
            self.stats["stream_messages"] += 1
            self.raw("ProposeStream", _StreamFuture(call))
        self.drop(state)
        return False

    # ---- sessions ----------------------------------------------------------------------

    def session(self) -> None:
        rng = self.rng
        mode = str(rng.choice(["separate", "fused", "stream", "batch"], p=[0.2, 0.3, 0.3, 0.2]))
        states = []
        for _ in range(int(rng.integers(2, 4)) if mode == "batch" else 1):
            state = self.alloc()
            if state is None:
                break
            if self.prefill(state, int(rng.integers(1, 41))):
                states.append(state)
        stream = self.client.stream() if mode == "stream" else None
        if stream is not None:
            self.stats["streams"] += 1
        try:
            for _ in range(int(rng.integers(1, 6))):
                if not states:
                    break
                states = self.step(states, mode, stream)
                if states and rng.random() < 0.03:
                    victim = states.pop(int(rng.integers(0, len(states))))
                    if self.fault(victim):
                        states.append(victim)
                if len(states) == 1 and rng.random() < 0.05:
                    moved = self.hand_over(states[0])
                    states = [moved] if moved is not None else []
        finally:
            if stream is not None:
                stream.close()
        self.end(states)
        self.stats["sessions"] += 1
        with self.ledger.lock:
            self.ledger.shared[self.ledger.base + SESSIONS] = self.stats["sessions"]

    def end(self, states: list[State]) -> None:
        how = str(self.rng.choice(["free", "abandon", "handle"], p=[0.75, 0.2, 0.05]))
        for state in states:
            if how == "handle" and not self.settle_pending(state):
                continue  # its lease ran out
            if how == "handle" and state.pending is None and state.rows:
                self.ledger.publish(blocks=blocks_for(state.rows), handles=1)
                handle = self.call("TakeKV", self.client.take_kv, state.id)
                if not isinstance(handle, DrafterError):
                    self.ledger.handles[handle.handle_id] = handle.num_rows
                    self.ledger.states[state.id] = 0
                    self.ledger.abandon_handle(handle.handle_id, time.monotonic())
                    self.stats["abandoned_handles"] += 1
                self.call("FreeState", self.client.free_state, state.id)
                self.ledger.states.pop(state.id, None)
            elif how == "free":
                self.call("FreeState", self.client.free_state, state.id)
                self.ledger.states.pop(state.id)
            else:
                self.ledger.abandon_state(state.id)
                self.stats["abandoned_states"] += 1
            self.ledger.publish()


class _StreamFuture:
    """A cancelled stream-stream call seen as a future: drains it, raising its status."""

    def __init__(self, call) -> None:
        self.call = call

    def result(self) -> None:
        for _ in self.call:
            pass


def run(
    index: int,
    address: str,
    shared,
    lock,
    results,
    *,
    seconds: float,
    least: int,
    seed: int,
    ttl: float,
    slack: float,
) -> None:
    """The process entry point: sessions until `seconds` have passed and at least `least`
    ran, however slow the machine; puts its figures."""
    worker = Worker(index, address, seed, shared, lock, ttl, slack)
    started = time.monotonic()
    while time.monotonic() - started < seconds or worker.stats["sessions"] < least:
        worker.session()
    worker.ledger.publish()
    results.put((index, dict(worker.stats), dict(worker.errors)))
    worker.client.close()
