"""The gRPC servicer: translates proto <-> engine calls and engine errors <-> status codes.

Every engine call runs on the engine's single worker thread (EngineRunner), so
the event loop stays free for health checks and other clients meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

from . import wire
from .engine import errors
from .engine.engine import DraftEngine, PrefillSession
from .engine.types import Proposal, ProposeArgs, Verdict

T = TypeVar("T")

ERROR_DOMAIN = "mtpdraft.v1"
_CODES: dict[type[errors.DrafterError], int] = {
    errors.NotFound: code_pb2.NOT_FOUND,
    errors.InvalidArgument: code_pb2.INVALID_ARGUMENT,
    errors.FailedPrecondition: code_pb2.FAILED_PRECONDITION,
    errors.ResourceExhausted: code_pb2.RESOURCE_EXHAUSTED,
    errors.Unavailable: code_pb2.UNAVAILABLE,
}


class EngineRunner:
    """Runs engine calls one at a time on a dedicated thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queues a call without waiting for it (cleanup from a cancelled handler)."""
        self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _status_of(err: errors.DrafterError) -> grpc.Status:
    details = [error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN)]
    if err.field is not None and isinstance(err, errors.InvalidArgument):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=err.field, description=err.message
        )
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    packed = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    status = status_pb2.Status(code=_CODES[type(err)], message=err.message, details=packed)
    return rpc_status.to_status(status)


def _verdict(msg: pb.Verdict, field: str) -> Verdict:
    refeed = None
    if msg.HasField("refeed_hiddens"):
        refeed = wire.decode_hiddens(msg.refeed_hiddens, f"{field}.refeed_hiddens")
    return Verdict(num_accepted=msg.num_accepted, refeed_hiddens=refeed)


def _propose_args(msg: pb.ProposeRequest) -> ProposeArgs:
    if not msg.HasField("hidden"):
        raise errors.InvalidArgument("hidden: required", reason="MISSING_FIELD", field="hidden")
    return ProposeArgs(
        state_id=msg.state_id,
        token=msg.token,
        hidden=wire.decode_hiddens(msg.hidden, "hidden"),
        position=msg.position,
        num_drafts=msg.num_drafts,
        bitmask=wire.decode_bitmask(msg.bitmask) if msg.HasField("bitmask") else None,
        min_confidence=msg.min_confidence,
        previous=_verdict(msg.previous, "previous") if msg.HasField("previous") else None,
    )


def _proposal(p: Proposal) -> pb.Proposal:
    return pb.Proposal(
        state_id=p.state_id,
        tokens=p.tokens,
        probs=p.probs,
        confidence=p.confidence,
        first_position=p.first_position,
    )


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, engine: DraftEngine, runner: EngineRunner, max_message_bytes: int) -> None:
        self.engine = engine
        self.runner = runner
        self.max_message_bytes = max_message_bytes

    async def _abort(self, context: grpc.aio.ServicerContext, err: errors.DrafterError) -> None:
        await context.abort_with_status(_status_of(err))

    async def GetInfo(self, request, context):
        info = await self.runner.call(self.engine.info)
        return pb.GetInfoResponse(
            **vars(info),
            hidden_dtypes=list(wire.HIDDEN_DTYPES),
            max_message_bytes=self.max_message_bytes,
        )

    async def AllocState(self, request, context):
        try:
            state_id = await self.runner.call(self.engine.alloc_state)
        except errors.DrafterError as err:
            await self._abort(context, err)
        return pb.AllocStateResponse(state_id=state_id)

    async def Prefill(self, request_iterator: AsyncIterator[pb.PrefillChunk], context):
        session: PrefillSession | None = None
        try:
            state_id = start = 0
            async for chunk in request_iterator:
                if session is None:
                    state_id, start = chunk.state_id, chunk.start_position
                    session = await self.runner.call(self.engine.begin_prefill, state_id, start)
                elif chunk.state_id not in (0, state_id) or chunk.start_position not in (0, start):
                    raise errors.InvalidArgument(
                        "a later chunk names another state or start_position than the first",
                        reason="CHUNK_MISMATCH",
                        field="state_id",
                    )
                if chunk.HasField("hiddens") or chunk.tokens:
                    hiddens = wire.decode_hiddens(chunk.hiddens, "hiddens")
                    await self.runner.call(session.append, list(chunk.tokens), hiddens)
            if session is None:
                raise errors.InvalidArgument(
                    "Prefill needs at least one chunk", reason="EMPTY_STREAM", field="state_id"
                )
            rows = await self.runner.call(session.finish)
            session = None
            return pb.PrefillResponse(num_rows=rows.num_rows, next_position=rows.next_position)
        except errors.DrafterError as err:
            await self._abort(context, err)
        finally:
            if session is not None:  # error, cancellation or a broken stream: roll back
                self.runner.submit(session.abort)

    async def Propose(self, request, context):
        try:
            args = _propose_args(request)
            proposal = await self.runner.call(self.engine.propose, args)
        except errors.DrafterError as err:
            await self._abort(context, err)
        return _proposal(proposal)

    async def ProposeBatch(self, request, context):
        try:
            batch = []
            for i, msg in enumerate(request.requests):
                try:
                    batch.append(_propose_args(msg))
                except errors.DrafterError as err:
                    err.message = f"requests[{i}].{err.message}"
                    raise
            proposals = await self.runner.call(self.engine.propose_batch, batch)
        except errors.DrafterError as err:
            await self._abort(context, err)
        return pb.ProposeBatchResponse(proposals=[_proposal(p) for p in proposals])

    async def AfterVerify(self, request, context):
        try:
            verdict = _verdict(request.verdict, "verdict")
            rows = await self.runner.call(self.engine.after_verify, request.state_id, verdict)
        except errors.DrafterError as err:
            await self._abort(context, err)
        return pb.AfterVerifyResponse(num_rows=rows.num_rows, next_position=rows.next_position)

    async def TakeKV(self, request, context):
        try:
            taken = await self.runner.call(self.engine.take_kv, request.state_id)
        except errors.DrafterError as err:
            await self._abort(context, err)
        return pb.TakeKVResponse(
            handle_id=taken.handle_id, num_rows=taken.num_rows, ttl_seconds=taken.ttl_seconds
        )

    async def InstallKV(self, request, context):
        try:
            rows = await self.runner.call(
                self.engine.install_kv, request.state_id, request.handle_id
            )
        except errors.DrafterError as err:
            await self._abort(context, err)
        return pb.InstallKVResponse(num_rows=rows.num_rows, next_position=rows.next_position)

    async def FreeState(self, request, context):
        existed = await self.runner.call(self.engine.free_state, request.state_id)
        return pb.FreeStateResponse(existed=existed)
