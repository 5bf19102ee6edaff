"""Limits: each one exceeded answers RESOURCE_EXHAUSTED with a clear message, changing nothing."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from drafting import hiddens, tokens
from servers import SERVER_ARGS, start_server

from mtpdraft.client import DrafterClient, ResourceExhausted

LIMITS = ("--max-states-per-client", "3", "--max-rows-per-state", "40", "--max-inflight", "3")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def limited(mimo_checkpoint):
    # "localhost" binds 127.0.0.1 and ::1 on one port: two client hosts on loopback.
    proc = start_server(mimo_checkpoint, *SERVER_ARGS, *LIMITS, "--host", "localhost")
    yield proc
    assert proc.stop() == 0


# A channel of its own: not the process's shared connection to the same target.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="needs ::1 for a second client host")
def test_states_per_client(limited) -> None:
    """The limit is each client host's: 127.0.0.1 at its limit is refused (on any of its
    connections) while ::1 still allocates, up to a limit of its own."""
    port = limited.address.rsplit(":", 1)[1]
    with (
        DrafterClient(f"127.0.0.1:{port}", timeout=10) as c,
        DrafterClient(f"127.0.0.1:{port}", timeout=10, options=OWN_CONNECTION) as same_host,
        DrafterClient(f"[::1]:{port}", timeout=10) as other,
    ):
        states = [c.alloc_state() for _ in range(3)]
        for client in (c, same_host):
            with pytest.raises(ResourceExhausted) as err:
                client.alloc_state()
            assert err.value.reason == "STATES_PER_CLIENT_EXCEEDED"
            assert "limit per client" in err.value.details
        others = [other.alloc_state() for _ in range(3)]  # the other host is not at its limit
        with pytest.raises(ResourceExhausted) as err:
            other.alloc_state()
        assert err.value.reason == "STATES_PER_CLIENT_EXCEEDED"
        assert c.info().live_states == 6
        other.free_state(others.pop())
        with pytest.raises(ResourceExhausted):  # another host's free makes no room here
            c.alloc_state()
        c.free_state(states.pop())
        states.append(same_host.alloc_state())  # freeing one makes room again
        others.append(other.alloc_state())
        for state in states:
            c.free_state(state)
        for state in others:
            other.free_state(state)
        assert c.info().live_states == 0


def test_rows_per_state(limited) -> None:
    with DrafterClient(limited.address, timeout=10) as c:
        state = c.alloc_state()
        free = c.info().kv_blocks_free
        with pytest.raises(ResourceExhausted) as err:
            c.prefill(state, tokens(41, 1), hiddens(41, 1), 1)
        assert err.value.reason == "ROWS_PER_STATE_EXCEEDED"
        assert c.info().kv_blocks_free == free  # the refused prompt left nothing behind
        c.prefill(state, tokens(36, 1), hiddens(36, 1), 1)
        # 36 rows + R0 + 4 speculative rows would be 41 rows: refused whole.
        with pytest.raises(ResourceExhausted):
            c.propose(state, 1, hiddens(1, 2), 37, 5)
        assert len(c.propose(state, 1, hiddens(1, 2), 37, 4).tokens) == 4
        c.after_verify(state, 0)
        c.free_state(state)


def test_concurrent_rpcs(limited) -> None:
    with DrafterClient(limited.address, timeout=10) as c:
        states = [c.alloc_state() for _ in range(3)]
        # Three open streams are the three RPCs the server takes at once...
        streams = [c.stream() for _ in range(3)]
        for stream, state in zip(streams, states, strict=True):
            assert len(stream.propose(state, 1, hiddens(1, 0), 1, 1).tokens) == 1
        # ...so a fourth call is refused by gRPC itself, until one of them ends.
        with pytest.raises(ResourceExhausted) as err:
            c.info()
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        streams.pop().close()
        for _ in range(100):  # the server frees the stream's place a moment after it ends
            try:
                assert c.info().live_states == 3
                break
            except ResourceExhausted:
                time.sleep(0.05)
        else:
            pytest.fail("the ended stream's place was not freed")
        for stream in streams:
            stream.close()
        for state in states:
            c.after_verify(state, 0)
            c.free_state(state)
