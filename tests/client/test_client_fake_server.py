"""Both clients against a tiny in-process fake servicer: the rich-error details
survive the real transport, Prefill streams its chunks, timeouts apply.

Not the drafter: the real service is tested end to end elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_status import rpc_status

from mtpdraft.client import (
    AsyncDrafterClient,
    DeadlineExceeded,
    DrafterClient,
    FailedPrecondition,
    InvalidArgument,
    KVHandle,
    ProposeArgs,
    StateNotFound,
    Verdict,
    wire,
)
from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc


class FakeDrafter(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, make_status: Any) -> None:
        self.make_status = make_status
        self.chunks: list[pb.PrefillChunk] = []
        self.proposes: list[pb.ProposeRequest] = []

    def GetInfo(self, request: Any, context: Any) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(model_family="fake", hidden_dtypes=[pb.DTYPE_BF16])

    def AllocState(self, request: Any, context: Any) -> pb.AllocStateResponse:
        time.sleep(0.5)
        return pb.AllocStateResponse(state_id=7)

    def Prefill(self, request_iterator: Iterator[pb.PrefillChunk], context: Any) -> Any:
        chunks = list(request_iterator)
        self.chunks.extend(chunks)
        n = sum(len(c.tokens) for c in chunks)
        return pb.PrefillResponse(num_rows=n, next_position=chunks[0].start_position + n)

    def Propose(self, request: pb.ProposeRequest, context: Any) -> pb.Proposal:
        self.proposes.append(request)
        if request.token < 0:
            code, msg = grpc.StatusCode.INVALID_ARGUMENT, "token -1 is outside the vocabulary"
            status = self.make_status(code, msg, reason="TOKEN_OUT_OF_RANGE", field="token")
            context.abort_with_status(rpc_status.to_status(status))
        k = request.num_drafts
        return pb.Proposal(
            state_id=request.state_id,
            tokens=[request.token + 1 + i for i in range(k)],
            probs=[0.5] * k,
            confidence=0.5,
            first_position=request.position + 1,
        )

    def ProposeBatch(self, request: pb.ProposeBatchRequest, context: Any) -> Any:
        """Row i drafts tokens[i] + 1, + 2, ...; a negative token fails its row."""
        size, ks = len(request.state_ids), list(request.num_drafts)
        ks = ks * size if len(ks) == 1 else ks
        answer = pb.ProposeBatchResponse(request_id=request.request_id, width=max(ks))
        rows = zip(request.tokens, ks, request.positions, strict=True)
        for row, (token, k, position) in enumerate(rows):
            k = 0 if token < 0 else k
            answer.drafts.extend([token + 1 + i for i in range(k)] + [-1] * (max(ks) - k))
            answer.probs.extend([0.5] * k + [0.0] * (max(ks) - k))
            answer.draft_counts.append(k)
            answer.confidences.append(0.5 if k else 0.0)
            answer.first_positions.append(position + 1 if k else 0)
            if token < 0:
                error = pb.Error(
                    code=3, message="outside", reason="TOKEN_OUT_OF_RANGE", field="tokens"
                )
                answer.errors.add(row=row, error=error)
        return answer

    def AfterVerify(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.NOT_FOUND, f"unknown state {request.state_id}")

    def TakeKV(self, request: Any, context: Any) -> pb.TakeKVResponse:
        return pb.TakeKVResponse(handle_id=11, num_rows=4, ttl_seconds=30.0)

    def InstallKV(self, request: pb.InstallKVRequest, context: Any) -> Any:
        code, msg = grpc.StatusCode.FAILED_PRECONDITION, "state 7 holds rows"
        status = self.make_status(
            code, f"{msg} (handle {request.handle_id})", reason="STATE_NOT_EMPTY"
        )
        context.abort_with_status(rpc_status.to_status(status))

    def FreeState(self, request: Any, context: Any) -> pb.FreeStateResponse:
        return pb.FreeStateResponse(existed=True)


@pytest.fixture
def fake(make_status: Any) -> Iterator[tuple[FakeDrafter, str]]:
    servicer = FakeDrafter(make_status)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_sync_client(fake: tuple[FakeDrafter, str]) -> None:
    servicer, target = fake
    servicer.chunks.clear()
    hiddens = torch.randn(50, 32).to(torch.bfloat16)
    with DrafterClient(target, timeout=5.0) as c:
        assert c.info().hidden_dtypes == ("bfloat16",)
        r = c.prefill(7, list(range(50)), hiddens, 1, chunk_bytes=1024)
        assert (r.num_rows, r.next_position) == (50, 51)
        # 13 rows of 32 bf16 + a token varint fit in 1024 bytes: 13 + 13 + 13 + 11.
        assert len(servicer.chunks) == 4 and all(c.ByteSize() <= 1024 for c in servicer.chunks)
        back = torch.cat([wire.decode_torch(ch.hiddens) for ch in servicer.chunks])
        assert torch.equal(back, hiddens)

        p = c.propose(7, 3, hiddens[0], 51, 3, previous=Verdict(2, hiddens[:2]))
        assert p.tokens == [4, 5, 6] and p.probs == [0.5] * 3 and p.first_position == 52
        assert servicer.proposes[-1].previous.num_accepted == 2
        ps = c.propose_many([ProposeArgs(s, 1, hiddens[0], 9, 2) for s in (1, 2)]).proposals()
        assert [q.state_id for q in ps] == [1, 2] and ps[1].tokens == [2, 3]
        one_bad = c.propose_batch([1, 2], [1, -1], [9, 9], hiddens[:2], 2)
        assert one_bad.counts.tolist() == [2, 0] and one_bad.proposal(0).first_position == 10
        assert (one_bad.errors[1].reason, one_bad.errors[1].field) == (
            "TOKEN_OUT_OF_RANGE",
            "tokens",
        )
        with pytest.raises(InvalidArgument):
            one_bad.proposal(1)
        with pytest.raises(ValueError):
            c.propose_many([])
        assert c.take_kv(7) == KVHandle(11, 4, 30.0)
        assert c.free_state(7) is True

        with pytest.raises(InvalidArgument) as e:
            c.propose(7, -1, hiddens[0], 51, 3)
        assert e.value.reason == "TOKEN_OUT_OF_RANGE" and e.value.field == "token"
        assert isinstance(e.value.__cause__, grpc.RpcError)
        with pytest.raises(StateNotFound) as nf:
            c.after_verify(5, 1)
        assert nf.value.details == "unknown state 5" and nf.value.reason is None
        with pytest.raises(FailedPrecondition) as fp:
            c.install_kv(7, KVHandle(11, 4, 30.0))
        assert fp.value.reason == "STATE_NOT_EMPTY" and "handle 11" in fp.value.details
        with pytest.raises(DeadlineExceeded):
            c.alloc_state(timeout=0.05)
        assert c.alloc_state() == 7  # the client default (5 s) applies again


def test_async_client(fake: tuple[FakeDrafter, str]) -> None:
    servicer, target = fake
    hidden = np.ones(32, np.float32)

    async def main() -> None:
        async with AsyncDrafterClient(target, timeout=5.0) as c:
            assert (await c.info()).model_family == "fake"
            servicer.chunks.clear()
            r = await c.prefill(7, [], np.zeros((0, 32), np.float32), 1)
            assert (r.num_rows, r.next_position) == (0, 1) and len(servicer.chunks) == 1
            servicer.chunks.clear()
            rows = np.arange(20 * 32, dtype=np.float16).reshape(20, 32)
            r = await c.prefill(7, np.arange(20), rows, 3, chunk_bytes=64 + 3 * (64 + 5))
            assert (r.num_rows, r.next_position) == (20, 23)
            assert [len(ch.tokens) for ch in servicer.chunks] == [3] * 6 + [2]
            back = np.concatenate([wire.decode(ch.hiddens) for ch in servicer.chunks])
            np.testing.assert_array_equal(back, rows)
            p = await c.propose(7, 3, hidden, 51, 2, bitmask=np.full(4, -1, np.int32))
            assert p.tokens == [4, 5] and p.confidence == 0.5
            ps = await c.propose_many([ProposeArgs(3, 1, hidden, 9, 1)])
            assert ps.proposal(0).tokens == [2] and ps.proposal(0).state_id == 3
            batch = await c.propose_batch(
                [4, 5], [1, 2], [9, 9], np.ones((2, 32), np.float32), [1, 2]
            )
            assert batch.drafts.tolist() == [[2, -1], [3, 4]]
            assert await c.free_state(7) is True
            with pytest.raises(InvalidArgument) as e:
                await c.propose(7, -1, hidden, 51, 3)
            assert e.value.reason == "TOKEN_OUT_OF_RANGE" and e.value.field == "token"
            assert e.value.domain == "mtpdraft.v1"
            with pytest.raises(StateNotFound):
                await c.after_verify(5, 1)
            with pytest.raises(FailedPrecondition) as fp:
                await c.install_kv(7, 12)
            assert fp.value.reason == "STATE_NOT_EMPTY" and "handle 12" in fp.value.details
            with pytest.raises(DeadlineExceeded):
                await c.alloc_state(timeout=0.05)

    asyncio.run(main())


def test_own_channel_is_left_open(fake: tuple[FakeDrafter, str]) -> None:
    _, target = fake
    channel = grpc.insecure_channel(target)
    with DrafterClient(channel=channel) as c:
        assert c.free_state(1) is True
    with DrafterClient(channel=channel) as c:  # still usable
        assert c.free_state(1) is True
    channel.close()
    with pytest.raises(ValueError):
        DrafterClient()
