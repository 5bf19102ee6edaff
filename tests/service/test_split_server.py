"""`mtpdraft serve --front-ends N`: what the split adds to the one-process server.

Every test of the service also runs against two front ends (the `server` fixture);
these are about the processes themselves: a front end killed mid-call, and the
last one going.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from drafting import hiddens
from servers import SERVER_ARGS, ServerProcess, front_end_pids, running, start_server

from mtpdraft.client import DrafterClient
from mtpdraft.client import messages as m
from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads /proc (Linux)")


def wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def connection_owners(pids: list[int], port: int) -> set[int]:
    """Which of `pids` hold an established TCP connection on local port `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == port and fields[3] == "01":  # ESTABLISHED
                    inodes.add(f"socket:[{fields[9]}]")
    owners = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    owners.add(pid)
            except OSError:  # closed meanwhile
                pass
    return owners


def output(server: ServerProcess) -> str:
    return "".join(server.lines) + server.process.stdout.read()


def test_a_killed_front_end_rolls_back_its_calls_and_the_other_serves_on(mimo_checkpoint):
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--front-ends", "2")
    try:
        front_ends = front_end_pids(server)
        assert len(front_ends) == 2
        port = int(server.address.rsplit(":", 1)[1])
        channel = grpc.insecure_channel(server.address)  # one connection, to one front end
        stub = pb_grpc.DrafterStub(channel)
        total = stub.GetInfo(pb.GetInfoRequest()).kv_blocks_total
        state = stub.AllocState(pb.AllocStateRequest()).state_id
        release = threading.Event()

        def first_chunk_then_hang():
            yield from m.prefill_chunks(state, [1, 2, 3, 4, 5, 6], hiddens(6, 1), 1)
            release.wait(60)

        prefill = stub.Prefill.future(first_chunk_then_hang())
        wait_until(lambda: stub.GetInfo(pb.GetInfoRequest()).kv_blocks_free < total)
        (owner,) = connection_owners(front_ends, port)
        os.kill(owner, signal.SIGKILL)
        # Until its sockets are closed, a new connection may still reach its listener.
        wait_until(lambda: not running(owner))
        with pytest.raises(grpc.RpcError) as cut:
            prefill.result(timeout=30)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        release.set()
        channel.close()

        with DrafterClient(server.address, timeout=10) as c:  # the other front end
            # The process's subchannel to the port is the one the kill broke: ready once
            # its reconnection (after gRPC's backoff) reaches the live front end.
            grpc.channel_ready_future(c.channel).result(timeout=30)
            # The engine cancelled the dead front end's Prefill: its rows are rolled back,
            # the state (the verifier's lease) is kept and takes a prefill again.
            wait_until(lambda: c.info().kv_blocks_free == total)
            assert c.info().live_states == 1
            assert c.prefill(state, [7, 8], hiddens(2, 2), 1).num_rows == 2
            assert c.free_state(state)
            assert c.info().live_states == 0
        assert server.process.poll() is None, "the server stopped with one front end left"
        assert server.stop() == 0
        assert "a front end went away: 1 open calls cancelled" in output(server)
    finally:
        server.stop()


def test_the_server_stops_once_every_front_end_is_gone(mimo_checkpoint):
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--front-ends", "2")
    try:
        with DrafterClient(server.address, timeout=10) as c:
            c.prefill(c.alloc_state(), [1, 2], hiddens(2, 3), 1)
        front_ends = front_end_pids(server)
        for pid in front_ends:
            os.kill(pid, signal.SIGKILL)
        assert server.process.wait(timeout=30) == 1
        out = output(server)
        assert "every front-end process has gone" in out
        assert "freed 1 live states" in out
    finally:
        server.stop()


def test_front_ends_stay_light_and_sigterm_stops_them_all(mimo_checkpoint):
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--front-ends", "3")
    front_ends = front_end_pids(server)
    assert len(front_ends) == 3
    with DrafterClient(server.address, timeout=10) as c:  # answers unpickled in a front end
        assert c.info().hidden_size > 0
        c.free_state(c.alloc_state())
    for pid in front_ends:  # the gRPC side needs no torch: a fraction of the memory and start
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read(), f"front end {pid} loaded torch"
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0
    for pid in front_ends:
        assert not running(pid), f"front end {pid} outlived it"
