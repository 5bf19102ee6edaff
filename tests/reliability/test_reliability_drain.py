"""Graceful drain under load: SIGTERM while verifiers stream (`--grace-period 5`, or a
grace longer than any wait when no verifier should need it).

Health turns NOT_SERVING, new states are refused with UNAVAILABLE, and no accepted
request is lost: every message sent on an open stream is answered, or the stream ends
with UNAVAILABLE / CANCELLED with that message among the few still in flight (counted).
Cooperative verifiers (they finish their step and free their states once health says
NOT_SERVING) let the server stop early; stubborn ones keep streaming through the grace,
and the server then frees what they hold: it exits 0 and prints `freed N live states`.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2
from reliability_support import (
    PATIENCE,
    ManagedServer,
    Pace,
    RawStream,
    batch_message,
    error_code,
    prefilled,
    propose_message,
    server_args,
    wait_until,
)
from servers import InProcessServer, small_engine

from mtpdraft.client import DrafterClient, Unavailable

GRACE = 5.0  # at least: it outlasts a BusyEngine LEASE_FACTOR times over too (`pace`)
# The grace where every verifier is cooperative: the server must stop long before it.
UNNEEDED_GRACE = PATIENCE
K = 3
WINDOW = 2  # states per stream, one message in flight each
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Verifier:
    """One verifier: a channel, WINDOW states, one ProposeStream, one step at a time."""

    address: str
    stubborn: bool
    draining: threading.Event
    sigterm: threading.Event
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    sent: int = 0
    answered: int = 0
    answered_keys: set = field(default_factory=set)  # (state, position) of answered messages
    errors: int = 0
    refused: int = 0
    after_sigterm: int = 0
    unanswered: int = 0
    freed: int = 0
    code: grpc.StatusCode | None = None
    states: list[int] = field(default_factory=list)
    failure: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by the test
            self.failure = exc

    def _run(self) -> None:
        with DrafterClient(self.address, timeout=PATIENCE) as c:
            self.states = [prefilled(c, 5, seed) for seed in range(WINDOW)]
            stream = RawStream(c._stub)  # no deadline: the server's stop ends it
            # per state: the position of its pending proposal (None: nothing pending)
            pending: dict[int, int | None] = dict.fromkeys(self.states)
            while True:
                if self.draining.is_set() and not self.stubborn:
                    break
                sigterm_sent = self.sigterm.is_set()
                waiting = []
                for s in self.states:
                    p = pending[s]
                    position, previous = (6, None) if p is None else (p + 1 + 1, 1)
                    message = propose_message(s, position, K, self.sent, previous=previous)
                    waiting.append(
                        (s, position, stream.send(batch_message(message, rid=next(self.ids))))
                    )
                    self.sent += 1
                for s, position, rid in waiting:
                    answer = stream.wait(rid)
                    if answer is None:  # the stream ended first
                        continue
                    self.answered += 1
                    self.answered_keys.add((s, position))
                    self.after_sigterm += sigterm_sent
                    if code := error_code(answer):
                        # Past the grace the server refuses new messages (UNAVAILABLE)
                        # and answers the ones it took; anything else is an error.
                        unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
                        self.refused += code == unavailable
                        self.errors += code != unavailable
                    else:
                        pending[s] = position
                if stream.code is not None:  # cut by the server's stop
                    self.unanswered = len(stream.unanswered())
                    self.code = stream.code
                    return
            # Cooperative: finish the step, settle, free, close the stream.
            for s in self.states:
                if pending[s] is not None:
                    c.after_verify(s, 0)
                assert c.free_state(s)
                self.freed += 1
            self.code = stream.finish()
            self.unanswered = len(stream.unanswered())


def _watch_health(server: ManagedServer, seen: threading.Event) -> None:
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            if server.health() != SERVING:
                seen.set()
                return
        except grpc.RpcError:
            return
        time.sleep(0.02)


@pytest.mark.parametrize("stubborn", [0, 2], ids=["cooperative", "two-stubborn"])
def test_sigterm_under_load_loses_no_accepted_request(
    mimo_checkpoint, pace: Pace, stubborn: int
) -> None:
    grace = pace.lease(GRACE) if stubborn else UNNEEDED_GRACE
    args = server_args(600.0, grace_period=grace)
    server = ManagedServer(mimo_checkpoint, *args)
    draining, sigterm = threading.Event(), threading.Event()
    verifiers = [
        Verifier(server.address, i < stubborn, draining, sigterm) for i in range(2 + stubborn)
    ]
    threads = [threading.Thread(target=v.run, daemon=True) for v in verifiers]
    watcher = threading.Thread(target=_watch_health, args=(server, draining), daemon=True)
    try:
        for t in threads:
            t.start()
        wait_until(lambda: all(v.answered >= 4 for v in verifiers), "traffic")
        info = server.info()
        assert info.live_states == WINDOW * len(verifiers) and not info.draining
        watcher.start()
        server.proc.process.send_signal(signal.SIGTERM)
        sent_at = time.monotonic()
        sigterm.set()
        assert draining.wait(PATIENCE), "health never turned NOT_SERVING"
        assert server.health("mtpdraft.v1.Drafter") != SERVING
        assert server.info().draining
        with DrafterClient(server.address, timeout=PATIENCE) as newcomer:
            with pytest.raises(Unavailable) as refused:
                newcomer.alloc_state()
            assert refused.value.reason == "DRAINING"
        code = server.wait_exit(grace + PATIENCE)
        stopped_after = time.monotonic() - sent_at
        for t in threads:
            t.join(PATIENCE)
    finally:
        if server.alive():
            server.proc.process.kill()
        server.stop()
    assert code == 0, server.log[-3000:]
    for v in verifiers:
        assert v.failure is None, v.failure
    held = sum(len(v.states) for v in verifiers if v.stubborn)
    assert f"freed {held} live states" in server.log
    server.assert_no_traceback()

    figures = {
        "stopped_after_s": round(stopped_after, 2),
        "sent": sum(v.sent for v in verifiers),
        "answered": sum(v.answered for v in verifiers),
        "answered_after_sigterm": sum(v.after_sigterm for v in verifiers),
        "unanswered_when_cut": sum(v.unanswered for v in verifiers),
        "freed_by_server": held,
        "stream_codes": sorted({v.code.name for v in verifiers}),
    }
    print(f"\ndrain ({stubborn} stubborn): {figures}")
    for v in verifiers:
        assert v.errors == 0  # live states are served to the end of the grace
        assert v.answered + v.unanswered == v.sent
        if v.stubborn:  # cut when the grace ended, with at most its window in flight
            assert v.code in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}, v.code
            assert v.unanswered <= WINDOW
            assert v.after_sigterm > 0
        else:  # finished its step, freed its states: nothing lost
            assert v.code == grpc.StatusCode.OK and v.unanswered == 0
            assert v.freed == WINDOW
    if stubborn:  # the grace waited out, then a prompt stop
        assert grace - 0.5 <= stopped_after <= grace + PATIENCE
    else:
        assert stopped_after < UNNEEDED_GRACE - 1, "the server waited out a grace nobody needed"


def test_requests_taken_before_the_grace_ends_are_answered(mimo_checkpoint) -> None:
    """In-process, to see which messages the server took: each one must be answered."""
    server = InProcessServer(small_engine(mimo_checkpoint))
    taken: set[tuple[int, int]] = set()
    enqueue = server.server.serving.scheduler.enqueue  # every stream message's way in, as a Step

    def recording_enqueue(step, *args, **kwargs):
        queued = enqueue(step, *args, **kwargs)  # a refused call is not taken
        taken.update(zip(step.state_ids.tolist(), step.positions.tolist(), strict=True))
        return queued

    server.server.serving.scheduler.enqueue = recording_enqueue
    draining, sigterm = threading.Event(), threading.Event()
    verifier = Verifier(server.address, True, draining, sigterm)
    thread = threading.Thread(target=verifier.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: verifier.answered >= 4, "traffic")
        grace = 1.5
        drained = asyncio.run_coroutine_threadsafe(server.server.drain(grace), server.loop)
        sigterm.set()
        time.sleep(grace - 0.5)
        # The engine is slow just as the grace ends (a long Prefill, say): the stream's
        # next messages are taken and wait for it.
        server.server.serving.runner.submit(time.sleep, 1.0)
        assert drained.result(PATIENCE) == WINDOW  # the verifier's states, freed by the server
        thread.join(PATIENCE)
    finally:
        server.loop.call_soon_threadsafe(server.loop.stop)
    assert verifier.failure is None, verifier.failure
    assert taken, "no request was seen taken: the recording missed the server's path"
    lost = taken - verifier.answered_keys
    assert not lost, f"{len(lost)} taken requests were never answered (stream {verifier.code})"
