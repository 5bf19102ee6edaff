"""The front-end processes of `mtpdraft serve --front-ends N` and signals: the front ends
ignore them, Ctrl-C drains the whole server through the engine process, the front ends
stop once the engine process is gone, and a front end that dies takes its queued
Proposes out of the engine's queue undrafted.

test_split_server.py has the rest of the split's lifecycle (a front end killed
mid-Prefill, the last one gone, SIGTERM stopping them all).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cli_server import CliServer, hold_the_engine
from drafting import hiddens
from servers import SERVER_ARGS, front_end_pids, running, start_server

from mtpdraft.client import DrafterClient, Unavailable

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads /proc (Linux)")


def wait_until(predicate, timeout: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_front_ends_ignore_signals_and_stop_once_the_engine_process_is_gone(mimo_checkpoint):
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--front-ends", "2")
    try:
        front_ends = front_end_pids(server)
        assert len(front_ends) == 2
        for pid in front_ends:  # a terminal's Ctrl-C reaches every process of the group
            os.kill(pid, signal.SIGINT)
            os.kill(pid, signal.SIGTERM)
        with DrafterClient(server.address, timeout=10) as c:
            for _ in range(8):  # fresh connections, spread over both
                with DrafterClient(server.address, timeout=10) as fresh:
                    fresh.free_state(fresh.alloc_state())
            time.sleep(0.5)
            assert all(running(pid) for pid in front_ends)
            assert c.info().live_states == 0
        # The engine process killed outright: no drain, no word to the front ends.
        server.process.kill()
        server.process.wait(10)
        wait_until(lambda: not any(running(pid) for pid in front_ends), what="front ends to stop")
        with DrafterClient(server.address, timeout=5) as c, pytest.raises(Unavailable):
            c.info()
    finally:
        server.stop()


def test_a_dead_front_ends_queued_proposes_are_never_drafted(mimo_checkpoint) -> None:
    server = CliServer("--model", str(mimo_checkpoint), *SERVER_ARGS, "--front-ends", "1")
    try:
        (process,) = server.server.processes
        with DrafterClient(server.address, timeout=30) as c, ThreadPoolExecutor(2) as pool:
            busy, queued = c.alloc_state(), c.alloc_state()
            entered, release = hold_the_engine(server.engine)
            try:
                calls = [pool.submit(c.propose, busy, 1, hiddens(1, 1)[0], 1, 2)]
                assert entered.wait(30), "the first call never reached the engine"
                calls.append(pool.submit(c.propose, queued, 1, hiddens(1, 2)[0], 1, 2))
                wait_until(lambda: server.scheduler.queued == 1, what="the queued call")
                process.kill()
                # The engine process sees the link close and cancels what it had open.
                wait_until(server.server.gone.is_set, what="the front end's link to close")
            finally:
                release.set()
            for call in calls:
                with pytest.raises(Unavailable):
                    call.result(30)
        wait_until(lambda: server.scheduler.queued == 0, what="the queue to empty")
        server.run(server.scheduler.settle(10))
        # Both states are kept (their verifier's lease); the queued call was not drafted.
        assert set(server.engine.states) == {busy, queued}
        assert server.engine.states[queued].pending is None
    finally:
        server.stop()


def test_ctrl_c_drains_the_whole_server(mimo_checkpoint) -> None:
    """A terminal's Ctrl-C sends SIGINT to every process of the group: the engine process
    drains (its grace period, then frees what is left) and the front ends wait for it."""
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--front-ends", "2")
    try:
        front_ends = front_end_pids(server)
        with DrafterClient(server.address, timeout=10) as c:
            c.prefill(c.alloc_state(), [1, 2, 3], hiddens(3, 1), 1)
        for pid in [server.process.pid, *front_ends]:
            os.kill(pid, signal.SIGINT)
        assert server.process.wait(30) == 0
        out = "".join(server.lines) + server.process.stdout.read()
        assert "draining (grace period 2 s)" in out and "freed 1 live states" in out
        wait_until(lambda: not any(running(pid) for pid in front_ends), what="front ends to stop")
    finally:
        server.stop()
