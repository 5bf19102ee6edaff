"""The gRPC servicer: translates proto <-> the serving loop's calls and engine errors <->
status codes.

The serving loop (serving/) runs the engine's calls; Propose calls of every kind
(unary, batch, each stream message) are batched across clients there. `convert` reads
each request into the engine's types before the loop sees it (every propose message
straight into a Step; INVALID_ARGUMENT for a malformed one) and makes the responses
from its results (a StepResult): no protobuf below this module. Each handler raises
engine errors; the `rpc` wrapper turns them into status codes (with ErrorInfo /
BadRequest details) and records the RPC's duration.

`add_to_server` registers the handlers with request deserializers that never
raise: bytes that do not parse as the method's message reach the handler as an
`Undecodable`, which it refuses as INVALID_ARGUMENT (reason MALFORMED_MESSAGE)
like any other bad request, with at most one log line per MALFORMED_LOG_PERIOD_S
(grpc would answer UNKNOWN and log a traceback for each, and end nothing on a stream).
`add_library_service` registers the health and reflection servicers so too, each
method behind a check that refuses an `Undecodable` the same way.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf import any_pb2, message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

from . import convert
from .engine import errors
from .engine.sampling import GREEDY
from .engine.step import StepResult
from .refusals import Throttle, refusals
from .telemetry import Telemetry

if TYPE_CHECKING:
    from .serving.loop import ServingLoop

log = logging.getLogger("mtpdraft.servicer")

ERROR_DOMAIN = "mtpdraft.v1"
# ExportKV's chunk when the request names no size, and what a chunk's message holds
# besides its K and V (header, tags, shapes) at most: a chunk fits max_message_bytes.
KV_CHUNK_BYTES = 1 << 20
KV_CHUNK_OVERHEAD = 1024
# At most one log line this often about requests that do not parse: junk cannot flood it.
MALFORMED_LOG_PERIOD_S = 10.0
_CODES: dict[type[errors.DrafterError], grpc.StatusCode] = {
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _pack(message) -> any_pb2.Any:
    holder = any_pb2.Any()
    holder.Pack(message)
    return holder


def _status_of(err: errors.DrafterError) -> grpc.Status:
    details = [_pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN))]
    if err.field is not None and isinstance(err, errors.InvalidArgument):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=err.field, description=err.message
        )
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    code = _CODES[type(err)].value[0]
    return rpc_status.to_status(status_pb2.Status(code=code, message=err.message, details=details))


def _error_value(err: errors.DrafterError) -> pb.Error:
    return pb.Error(
        code=_CODES[type(err)].value[0], message=err.message, reason=err.reason, field=err.field
    )


def _stream_error(err: BaseException) -> pb.Error:
    """A failed stream message's answer: its error, or INTERNAL for a bug (logged)."""
    if isinstance(err, errors.DrafterError):
        return _error_value(err)
    log.error("a ProposeStream message failed", exc_info=err)
    return pb.Error(
        code=grpc.StatusCode.INTERNAL.value[0],
        message=f"internal error: {type(err).__name__}",
        reason="INTERNAL",
    )


def _row_error(err: errors.DrafterError) -> pb.Error:
    """A ProposeBatch row's error, naming the column its field comes from."""
    error = _error_value(err)
    error.field = convert.COLUMN_OF_FIELD.get(err.field or "", err.field or "")
    return error


def _log_refused(
    err: errors.DrafterError, context: grpc.aio.ServicerContext, field: str | None = None
) -> None:
    """A refused request's debug line (refusals.py); nothing to do unless debug is on."""
    if refusals.enabled():
        code = _CODES[type(err)].name
        refusals.refused(code, err.reason, field or err.field, context.peer(), err.message)


def _client_host(peer: str) -> str:
    """The client's host from a gRPC peer string ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678")."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rsplit(":", 1)[0]
    return peer


class Undecodable:
    """What a request deserializer gives for bytes that do not parse as `message_type`."""

    __slots__ = ("message_type",)

    def __init__(self, message_type: str) -> None:
        self.message_type = message_type


def _parser(message_class) -> Callable[[bytes], object]:
    """`message_class`'s deserializer, an `Undecodable` where it would raise."""
    parse, undecodable = message_class.FromString, Undecodable(message_class.DESCRIPTOR.full_name)

    def parse_or_mark(data: bytes):
        try:
            return parse(data)
        except DecodeError:
            return undecodable

    return parse_or_mark


class _MalformedLog:
    """Logs refused undecodable messages: a line at once, then at most one a period,
    counting those it stood for."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._throttle = Throttle(rate=1 / period, burst=1)

    def refused(self, message: Undecodable, peer: str) -> errors.InvalidArgument:
        """The error that answers `message`, logged."""
        held = self._throttle.take("malformed")
        if held is not None:
            log.warning(
                "%d request message(s) refused since the last such line: they do not parse "
                "(the last as a %s, from %s); at most one such line every %g s",
                held + 1,
                message.message_type,
                peer,
                self.period,
            )
        return errors.InvalidArgument(
            f"the request's bytes do not parse as {message.message_type}",
            reason="MALFORMED_MESSAGE",
        )


_malformed = _MalformedLog(MALFORMED_LOG_PERIOD_S)


async def _parsed(messages: AsyncIterator, peer: str) -> AsyncIterator:
    """A client stream's messages; INVALID_ARGUMENT at one that does not parse."""
    async for msg in messages:
        if type(msg) is Undecodable:
            raise _malformed.refused(msg, peer)
        yield msg


Handler = Callable[..., Awaitable]


def rpc(handler: Handler) -> Handler:
    """Maps engine errors to status codes and records the RPC's duration and outcome."""

    @functools.wraps(handler)
    async def wrapper(self: DrafterServicer, request, context: grpc.aio.ServicerContext):
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            if type(request) is Undecodable:
                raise _malformed.refused(request, context.peer())
            return await handler(self, request, context)
        except errors.DrafterError as err:
            code = _CODES[type(err)]
            _log_refused(err, context)
            span = trace.get_current_span()
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.set_status(Status(StatusCode.ERROR, err.message))
            await context.abort_with_status(_status_of(err))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.telemetry.record_rpc(handler.__name__, code, time.perf_counter() - started)

    return wrapper


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, serving: ServingLoop, telemetry: Telemetry, max_message_bytes: int) -> None:
        self.serving = serving
        # What a propose message is checked against as it becomes a Step.
        self.shape = serving.engine.step_shape
        self.telemetry = telemetry
        self.max_message_bytes = max_message_bytes

    @rpc
    async def GetInfo(self, request, context):
        return convert.info(await self.serving.info(), self.max_message_bytes)

    @rpc
    async def AllocState(self, request, context):
        sampling = convert.sampling(request.sampling) if request.HasField("sampling") else GREEDY
        grammar = convert.grammar(request)
        state_id = await self.serving.alloc_state(_client_host(context.peer()), sampling, grammar)
        return pb.AllocStateResponse(state_id=state_id)

    @rpc
    async def Prefill(self, request_iterator: AsyncIterator[pb.PrefillChunk], context):
        with self.telemetry.kv_span("prefill"):
            chunks = _parsed(request_iterator, context.peer())
            rows = await self.serving.prefill(convert.prefill_chunk(c) async for c in chunks)
        return pb.PrefillResponse(num_rows=rows.num_rows, next_position=rows.next_position)

    @rpc
    async def Propose(self, request, context):
        step = convert.propose(request, self.shape)
        caller = self.telemetry.span_context()
        result = await self.serving.propose(step, context.time_remaining(), caller)
        if result.errors:  # its one row's: the call's status
            raise result.errors[0]
        return convert.proposal(step, result, request.return_bitmasks)

    @rpc
    async def ProposeBatch(self, request, context):
        step = convert.batch(request, self.shape)
        caller = self.telemetry.span_context()
        result = await self.serving.propose(step, context.time_remaining(), caller)
        return self._batch_answer(request, result, context)

    async def ProposeStream(self, request_iterator: AsyncIterator, context):
        """Each message a ProposeBatch, answered as the unary call is; a message that
        fails as a whole is answered with its error (see _answer_stream)."""

        caller = self.telemetry.span_context()  # the stream's, for all its messages

        def submit(msg: pb.ProposeBatchRequest):
            step = convert.batch(msg, self.shape)
            return self.serving.propose(step, context.time_remaining(), caller)

        def refuse(request_id: int, error: pb.Error):
            return pb.ProposeBatchResponse(request_id=request_id, error=error)

        def reply(msg: pb.ProposeBatchRequest, result: StepResult) -> pb.ProposeBatchResponse:
            return self._batch_answer(msg, result, context)

        async for answer in self._answer_stream(
            "ProposeStream", request_iterator, context, submit, reply, refuse
        ):
            yield answer

    def _batch_answer(
        self, msg: pb.ProposeBatchRequest, result: StepResult, context: grpc.aio.ServicerContext
    ) -> pb.ProposeBatchResponse:
        failed = {row: _row_error(err) for row, err in result.errors.items()}
        if failed and refusals.enabled():
            for row, err in result.errors.items():
                _log_refused(err, context, f"{failed[row].field or 'row'}[{row}]")
        return convert.batch_answer(msg.request_id, result, failed, msg.return_bitmasks)

    async def _answer_stream(self, name, request_iterator, context, submit, reply, refuse):
        """An async generator of a propose stream's answers (the form gRPC interceptors
        expect of a stream).

        Each message is queued with the scheduler as it is read (`submit`), and its
        answer is made by a callback on the job's future (`reply`): no task per
        message, since a task's start and wake-ups cost the loop more than the
        message's own work when many streams are busy. Errors are answers
        (`refuse`), not statuses, so the `rpc` wrapper is not needed here; the RPC's
        duration is recorded all the same. A message that does not parse is
        answered so too, with request_id 0.
        """
        started, code = time.perf_counter(), grpc.StatusCode.OK
        answers: asyncio.Queue = asyncio.Queue()
        in_flight: set[asyncio.Future] = set()

        def answer(msg, job: asyncio.Future) -> None:
            in_flight.discard(job)
            if job.cancelled():  # the stream is going away
                return
            if (err := job.exception()) is not None:
                if isinstance(err, errors.DrafterError):
                    _log_refused(err, context)
                answers.put_nowait(refuse(msg.request_id, _stream_error(err)))
            else:
                answers.put_nowait(reply(msg, job.result()))

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    if type(msg) is Undecodable:  # its request_id cannot be read: 0
                        err = _malformed.refused(msg, context.peer())
                        _log_refused(err, context)
                        answers.put_nowait(refuse(0, _error_value(err)))
                        continue
                    try:
                        job = submit(msg)
                    except errors.DrafterError as err:
                        _log_refused(err, context)
                        answers.put_nowait(refuse(msg.request_id, _error_value(err)))
                        continue
                    in_flight.add(job)
                    job.add_done_callback(functools.partial(answer, msg))
                if in_flight:
                    await asyncio.wait(list(in_flight))
            finally:
                answers.put_nowait(None)  # also when reading failed: the stream ends, never hangs

        reader = asyncio.create_task(read())
        try:
            while (answer_ := await answers.get()) is not None:
                yield answer_
            await reader  # surfaces a broken request stream
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            reader.cancel()
            for job in list(in_flight):
                job.cancel()
            self.telemetry.record_rpc(name, code, time.perf_counter() - started)

    @rpc
    async def AfterVerify(self, request, context):
        with self.telemetry.kv_span("after_verify"):
            verdict = convert.verdict(request.verdict, "verdict")
            rows = await self.serving.after_verify(request.state_id, verdict)
        return pb.AfterVerifyResponse(num_rows=rows.num_rows, next_position=rows.next_position)

    @rpc
    async def TakeKV(self, request, context):
        with self.telemetry.kv_span("take"):
            taken = await self.serving.take_kv(request.state_id)
        return pb.TakeKVResponse(
            handle_id=taken.handle_id, num_rows=taken.num_rows, ttl_seconds=taken.ttl_seconds
        )

    @rpc
    async def InstallKV(self, request, context):
        with self.telemetry.kv_span("install"):
            rows = await self.serving.install_kv(request.state_id, request.handle_id)
        return pb.InstallKVResponse(num_rows=rows.num_rows, next_position=rows.next_position)

    async def ExportKV(self, request, context):
        """A handle's KV as chunks (a server stream, so not under `rpc`: its errors are
        mapped here)."""
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            if type(request) is Undecodable:
                raise _malformed.refused(request, context.peer())
            if request.max_chunk_bytes < 0:
                raise errors.InvalidArgument(
                    f"max_chunk_bytes: {request.max_chunk_bytes} is negative (0: the default)",
                    reason="CHUNK_SIZE_OUT_OF_RANGE",
                    field="max_chunk_bytes",
                )
            asked = request.max_chunk_bytes or KV_CHUNK_BYTES
            size = min(asked, self.max_message_bytes - KV_CHUNK_OVERHEAD)
            chunks = self.serving.export_kv(request.handle_id, size, request.keep_handle)
            async for chunk in chunks:
                yield convert.kv_chunk(chunk)
        except errors.DrafterError as err:
            code = _CODES[type(err)]
            _log_refused(err, context)
            await context.abort_with_status(_status_of(err))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.telemetry.record_rpc("ExportKV", code, time.perf_counter() - started)

    @rpc
    async def ImportKV(self, request_iterator: AsyncIterator[pb.KVChunk], context):
        with self.telemetry.kv_span("import"):
            chunks = _parsed(request_iterator, context.peer())
            rows = await self.serving.import_kv(convert.read_kv_chunk(c) async for c in chunks)
        return pb.ImportKVResponse(num_rows=rows.num_rows, next_position=rows.next_position)

    @rpc
    async def FreeState(self, request, context):
        with self.telemetry.kv_span("free"):
            existed = await self.serving.free_state(request.state_id)
        return pb.FreeStateResponse(existed=existed)


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_to_server(servicer: DrafterServicer, server: grpc.aio.Server) -> None:
    """As the generated add_DrafterServicer_to_server, but every method's request
    deserializer hands bytes that do not parse to the handler as an `Undecodable`
    (which the Drafter's handlers refuse themselves)."""
    service = pb.DESCRIPTOR.services_by_name["Drafter"]
    _add_service(service, servicer, server, lambda method, streamed: method)


def add_library_service(service: ServiceDescriptor, servicer, server: grpc.aio.Server) -> None:
    """A library's servicer (health, reflection) registered as the Drafter service is:
    bytes that do not parse are refused as INVALID_ARGUMENT (MALFORMED_MESSAGE) before
    the servicer sees them, where its generated registration would answer UNKNOWN and
    log a traceback."""
    _add_service(service, servicer, server, _refusing_undecodable)


def _add_service(service: ServiceDescriptor, servicer, server: grpc.aio.Server, guard) -> None:
    """Registers `guard(method, streamed)` for each of the service's methods (`streamed`:
    it takes a stream of requests), their requests read by `_parser`."""
    handlers = {}
    for method in service.methods:
        make = _HANDLERS[method.client_streaming, method.server_streaming]
        request, response = map(
            message_factory.GetMessageClass, (method.input_type, method.output_type)
        )
        handlers[method.name] = make(
            guard(getattr(servicer, method.name), method.client_streaming),
            request_deserializer=_parser(request),
            response_serializer=response.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def _refusing_undecodable(method: Callable, streamed: bool) -> Callable:
    """`method` (a library servicer's: a coroutine or an async generator) behind a check
    that refuses an `Undecodable` request. A stream of requests ends for `method` at the
    first one, and the call with its error once `method` is done."""

    async def checked(request, context) -> tuple[object, list[Undecodable]]:
        refused: list[Undecodable] = []
        if streamed:
            return _until_undecodable(request, refused), refused
        if type(request) is Undecodable:
            await _refuse(request, context)
        return request, refused

    if inspect.isasyncgenfunction(method):

        async def guarded(request, context):
            request, refused = await checked(request, context)
            async for answer in method(request, context):
                yield answer
            if refused:
                await _refuse(refused[0], context)

    else:

        async def guarded(request, context):
            request, refused = await checked(request, context)
            result = await method(request, context)
            if refused:
                await _refuse(refused[0], context)
            return result

    return functools.wraps(method)(guarded)


async def _until_undecodable(requests: AsyncIterator, refused: list) -> AsyncIterator:
    """The requests up to the first that does not parse, which goes into `refused`."""
    async for request in requests:
        if type(request) is Undecodable:
            refused.append(request)
            return
        yield request


async def _refuse(message: Undecodable, context: grpc.aio.ServicerContext) -> None:
    err = _malformed.refused(message, context.peer())
    _log_refused(err, context)
    await context.abort_with_status(_status_of(err))
