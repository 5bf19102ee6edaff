"""Requests whose bytes do not parse as the method's message, over a real server.

A broken or hostile client sends them through a generic channel that passes
bytes as they are. Every method refuses them with INVALID_ARGUMENT and the
ErrorInfo reason MALFORMED_MESSAGE; ProposeStream answers each with an error
(request_id 0) and goes on; nothing changes on the server, and the server's log
gets at most one line every MALFORMED_LOG_PERIOD_S, however many come.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import grpc
import pytest
from drafting import hiddens, tokens
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status
from servers import SERVER_ARGS, ServerProcess, start_server

from mtpdraft.client import DrafterClient
from mtpdraft.client import messages as m
from mtpdraft.service.servicer import ERROR_DOMAIN, MALFORMED_LOG_PERIOD_S
from mtpdraft.v1 import drafter_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Drafter"]
UNARY = [x.name for x in SERVICE.methods if not x.client_streaming and not x.server_streaming]
# Bytes no message parses: a field tag past the varint's ten bytes, and a string
# field whose length runs past the end.
JUNK = (b"\xff" * 16, b"\x0a\x05ab")
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
TIMEOUT = 30.0  # a call that hangs fails the test here, not at the suite's timeout


@dataclass
class Served:
    server: ServerProcess

    def new_log(self) -> str:
        """What the server wrote since the last call. Every line a call causes is
        written before its answer leaves, so it is in the pipe once the answer came."""
        return self.server.new_output()


@pytest.fixture(scope="module")
def served(mimo_checkpoint):
    server = start_server(mimo_checkpoint, *SERVER_ARGS)
    os.set_blocking(server.process.stdout.fileno(), False)
    yield Served(server)
    server.stop()


@pytest.fixture
def channel(served: Served):
    with grpc.insecure_channel(served.server.address) as ch:
        yield ch


@pytest.fixture
def client(served: Served):
    with DrafterClient(served.server.address, timeout=TIMEOUT) as c:
        yield c
        info = c.info()
        assert info.live_states == 0, "a state leaked"
        assert info.kv_blocks_free == info.kv_blocks_total, "KV blocks leaked"


def path(method: str) -> str:
    return f"/{SERVICE.full_name}/{method}"


def assert_malformed(err: grpc.RpcError) -> None:
    assert err.code() == INVALID_ARGUMENT, err.details()
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status details"
    info = error_details_pb2.ErrorInfo()
    assert status.details and status.details[0].Unpack(info)
    assert (info.reason, info.domain) == ("MALFORMED_MESSAGE", ERROR_DOMAIN)
    assert "parse" in err.details()


def prefilled(client: DrafterClient, rows: int, seed: int) -> int:
    state = client.alloc_state()
    client.prefill(state, tokens(rows, seed), hiddens(rows, seed), 1)
    return state


def test_every_unary_rpc_refuses_junk_and_changes_nothing(
    served: Served, channel, client: DrafterClient
) -> None:
    state = prefilled(client, 4, 1)
    before = client.info()
    served.new_log()
    for method in UNARY:
        call = channel.unary_unary(path(method))  # no serializers: the bytes as they are
        for junk in JUNK:
            with pytest.raises(grpc.RpcError) as err:
                call(junk, timeout=TIMEOUT)
            assert_malformed(err.value)
    after = client.info()
    assert (after.live_states, after.kv_blocks_free) == (before.live_states, before.kv_blocks_free)
    # The state still holds its 4 rows: a fifth goes at position 5.
    assert client.prefill(state, tokens(1, 2), hiddens(1, 2), 5).num_rows == 5
    client.free_state(state)
    assert "Traceback" not in served.new_log()


def test_a_prefill_with_a_junk_chunk_leaves_the_state_as_it_was(
    served: Served, channel, client: DrafterClient
) -> None:
    state = prefilled(client, 4, 3)
    free = client.info().kv_blocks_free
    # Two rows at 5 (a block's worth past the first), then junk; junk first; junk alone.
    good = [c.SerializeToString() for c in m.prefill_chunks(state, tokens(2, 4), hiddens(2, 4), 5)]
    prefill = channel.stream_unary(path("Prefill"))
    for stream in ([*good, JUNK[0]], [JUNK[1], *good], [JUNK[0]]):
        with pytest.raises(grpc.RpcError) as err:
            prefill(iter(stream), timeout=TIMEOUT)
        assert_malformed(err.value)
        assert client.info().kv_blocks_free == free
    done = client.prefill(state, tokens(2, 4), hiddens(2, 4), 5)
    assert (done.num_rows, done.next_position) == (6, 7)
    client.free_state(state)


def test_propose_stream_answers_junk_and_serves_the_messages_after_it(
    channel, client: DrafterClient
) -> None:
    first, second = prefilled(client, 3, 5), prefilled(client, 3, 6)
    requests = [
        JUNK[0],
        m.batch_request([first], [7], [4], hiddens(1, 7), 2),
        JUNK[1],
        m.batch_request([second], [8], [4], hiddens(1, 8), 3),
    ]
    for i, msg in enumerate(requests):  # request ids 1..4 where the bytes carry one
        if msg not in JUNK:
            msg.request_id = i + 1
            requests[i] = msg.SerializeToString()
    stream = channel.stream_stream(
        path("ProposeStream"), response_deserializer=pb.ProposeBatchResponse.FromString
    )
    call = stream(iter(requests), timeout=TIMEOUT)
    answers = list(call)
    assert call.code() == grpc.StatusCode.OK
    errors = [a for a in answers if a.HasField("error")]
    assert len(errors) == 2
    for a in errors:
        assert a.request_id == 0  # the message's own id could not be read
        assert (a.error.code, a.error.reason) == (INVALID_ARGUMENT.value[0], "MALFORMED_MESSAGE")
    drafted = {a.request_id: list(a.draft_counts) for a in answers if not a.HasField("error")}
    assert drafted == {2: [2], 4: [3]}
    for state in (first, second):
        client.after_verify(state, 0)
        client.free_state(state)


def test_much_junk_writes_a_bounded_log(served: Served, channel, client: DrafterClient) -> None:
    served.new_log()
    started = time.monotonic()
    unary = [channel.unary_unary(path(method)) for method in UNARY]
    for i in range(20):
        for call in unary:
            with pytest.raises(grpc.RpcError) as err:
                call(JUNK[i % 2], timeout=TIMEOUT)
            assert_malformed(err.value)
    prefill = channel.stream_unary(path("Prefill"))
    for junk in JUNK * 10:
        with pytest.raises(grpc.RpcError):
            prefill(iter([junk]), timeout=TIMEOUT)
    stream = channel.stream_stream(path("ProposeStream"))
    assert len(list(stream(iter(JUNK * 20), timeout=TIMEOUT))) == 40
    assert client.info().live_states == 0  # a valid call still answers
    elapsed = time.monotonic() - started
    log = served.new_log()
    assert "Traceback" not in log and "DecodeError" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if "do not parse" in line]
    # One line at first, then one per period at most.
    assert len(lines) <= 1 + elapsed / MALFORMED_LOG_PERIOD_S, log[-3000:]


def test_health_and_reflection_refuse_junk_as_the_drafter_does(served: Served, channel) -> None:
    """INVALID_ARGUMENT (MALFORMED_MESSAGE) and no traceback, where the stock servicers'
    registration answered UNKNOWN and logged one; a valid request still answers."""
    served.new_log()
    check = channel.unary_unary("/grpc.health.v1.Health/Check")
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
    reflect = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    )
    for junk in JUNK:
        with pytest.raises(grpc.RpcError) as err:
            check(junk, timeout=TIMEOUT)
        assert_malformed(err.value)
        with pytest.raises(grpc.RpcError) as err:
            list(watch(junk, timeout=TIMEOUT))
        assert_malformed(err.value)
        with pytest.raises(grpc.RpcError) as err:
            list(reflect(iter([junk]), timeout=TIMEOUT))
        assert_malformed(err.value)
    # A reflection stream answers the requests before the junk, then ends refusing it.
    list_services = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    answers = []
    with pytest.raises(grpc.RpcError) as err:
        answers.extend(reflect(iter([list_services, JUNK[0]]), timeout=TIMEOUT))
    assert_malformed(err.value)
    listed = reflection_pb2.ServerReflectionResponse.FromString(answers[0])
    assert "grpc.health.v1.Health" in {s.name for s in listed.list_services_response.service}
    healthy = health_pb2.HealthCheckResponse.FromString(
        check(health_pb2.HealthCheckRequest().SerializeToString(), timeout=TIMEOUT)
    )
    assert healthy.status == health_pb2.HealthCheckResponse.SERVING
    log = served.new_log()
    assert "Traceback" not in log and "DecodeError" not in log, log[-3000:]
