"""The hot path: one ProposeStream per verifier, one message per verify step.

Each message is a ProposeBatch of the verifier's states (``step`` takes the arguments of
``propose_batch``; ``propose`` sends one state as a batch of one), usually carrying each
state's verdict on its last proposal: one round trip per verify step. Many messages can
be in flight at once (``submit`` returns a future); answers are matched by request id,
and two messages naming one state are served in the order sent. A failed row has its
error in the answer's ``errors``; a message that fails as a whole raises its typed error
and leaves the stream open. A stream has no deadline unless opened with one
(``client.stream(timeout=...)``, for the whole stream); the client's default timeout is
for its unary calls. ``step`` and ``propose`` may bound their wait for the answer
(``timeout=``): past it they raise DeadlineExceeded, and the message may still be
applied, so send it again with the same step numbers (``recovery.retry_step``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Any

import grpc

from mtpdraft.v1 import drafter_pb2 as pb

from . import messages as m
from .errors import DeadlineExceeded, DrafterError, Unavailable, error_from_value, from_rpc_error
from .types import BatchResult, Proposal, ProposeArgs
from .wire import Array

_CLOSE = object()


def _outcome(resp: pb.ProposeBatchResponse, state_ids: Any) -> BatchResult | DrafterError:
    if resp.HasField("error"):
        return error_from_value(resp.error)
    return m.parse_batch(resp, state_ids)


def _closed() -> DrafterError:
    return Unavailable(grpc.StatusCode.UNAVAILABLE, "the propose stream is closed")


def _unanswered(timeout: float) -> DrafterError:
    """A message whose answer did not come in time: the server may still apply it."""
    return DeadlineExceeded(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"no answer on the stream within {timeout:g} s (the message may still be applied: "
        "send it again with the same step numbers)",
    )


def _one_state(
    state: int,
    token: int,
    hidden: Array,
    position: int,
    num_drafts: int,
    *,
    return_bitmasks: bool = False,
    **options: Any,
) -> pb.ProposeBatchRequest:
    """A batch of one state: the arguments of ``DrafterClient.propose``, its keyword
    options those of ProposeArgs."""
    args = ProposeArgs(state, token, hidden, position, num_drafts, **options)
    return m.batch_request_of([args], return_bitmasks)


class ProposeStream:
    """A blocking client's stream. Thread-safe; use as a context manager."""

    def __init__(self, stub: Any, timeout: float | None, metadata: m.Metadata = None) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[int, tuple[Future, Any]] = {}  # request id -> (future, state ids)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._failure: DrafterError = _closed()  # why the stream ended, once it has
        requests = iter(self._requests.get, _CLOSE)
        self._call = stub.ProposeStream(requests, timeout=timeout, metadata=metadata)
        self._reader = threading.Thread(target=self._read, daemon=True, name="propose-stream")
        self._reader.start()

    def submit(self, *columns: Any, **kwargs: Any) -> Future[BatchResult]:
        """Sends one step (the arguments of `DrafterClient.propose_batch`); returns the future
        of its answer."""
        return self._send(m.batch_request(*columns, **kwargs))

    def step(self, *columns: Any, timeout: float | None = None, **kwargs: Any) -> BatchResult:
        """One verify step's round trip: the arguments of `DrafterClient.propose_batch`;
        DeadlineExceeded when no answer came within `timeout` seconds (None: no bound)."""
        return self._answer(self.submit(*columns, **kwargs), timeout)

    def propose(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Proposal:
        """One state's round trip, a batch of one (the arguments of `DrafterClient.propose`);
        raises its error if it failed, DeadlineExceeded as `step` does."""
        return self._answer(self._send(_one_state(*args, **kwargs)), timeout).proposal(0)

    @staticmethod
    def _answer(future: Future[BatchResult], timeout: float | None) -> BatchResult:
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError from 3.11 on
            raise _unanswered(timeout) from None

    def _send(self, request: pb.ProposeBatchRequest) -> Future[BatchResult]:
        future: Future[BatchResult] = Future()
        with self._lock:
            if self._closed:
                raise self._failure
            request.request_id = next(self._ids)
            self._futures[request.request_id] = (future, request.state_ids)
        self._requests.put(request)
        return future

    def _read(self) -> None:
        failure: DrafterError = _closed()
        try:
            for resp in self._call:
                with self._lock:
                    future, state_ids = self._futures.pop(resp.request_id, (None, None))
                if future is not None:
                    outcome = _outcome(resp, state_ids)
                    if isinstance(outcome, DrafterError):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
        except grpc.RpcError as err:
            failure = from_rpc_error(err)
        with self._lock:
            self._closed = True
            self._failure = failure
            pending, self._futures = self._futures, {}
        for future, _ in pending.values():
            future.set_exception(failure)

    def close(self) -> None:
        """Ends the stream once the answers in flight have arrived."""
        self._requests.put(_CLOSE)
        self._reader.join()

    def __enter__(self) -> ProposeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncProposeStream:
    """An asyncio client's stream (see ProposeStream); use with `async with`."""

    def __init__(self, stub: Any, timeout: float | None, metadata: m.Metadata = None) -> None:
        self._call = stub.ProposeStream(timeout=timeout, metadata=metadata)
        self._futures: dict[int, tuple[asyncio.Future, Any]] = {}  # id -> (future, state ids)
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._failure: DrafterError = _closed()  # why the stream ended, once it has
        self._reader = asyncio.create_task(self._read())

    async def submit(self, *columns: Any, **kwargs: Any) -> asyncio.Future[BatchResult]:
        """Sends one step (the arguments of `propose_batch`); returns the future of its
        answer."""
        return await self._send(m.batch_request(*columns, **kwargs))

    async def step(self, *columns: Any, timeout: float | None = None, **kwargs: Any) -> BatchResult:
        """One verify step's round trip: the arguments of `propose_batch`; DeadlineExceeded
        when no answer came within `timeout` seconds (None: no bound)."""
        return await self._answer(await self.submit(*columns, **kwargs), timeout)

    async def propose(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Proposal:
        """One state's round trip, a batch of one (the arguments of `propose`); raises its
        error if it failed, DeadlineExceeded as `step` does."""
        answer = await self._send(_one_state(*args, **kwargs))
        return (await self._answer(answer, timeout)).proposal(0)

    @staticmethod
    async def _answer(future: asyncio.Future[BatchResult], timeout: float | None) -> BatchResult:
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11 on
            raise _unanswered(timeout) from None

    async def _send(self, request: pb.ProposeBatchRequest) -> asyncio.Future[BatchResult]:
        if self._reader.done():
            raise self._failure
        request.request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._futures[request.request_id] = (future, request.state_ids)
        async with self._write_lock:  # one write at a time on a grpc.aio call
            await self._call.write(request)
        return future

    async def _read(self) -> None:
        failure: DrafterError = _closed()
        try:
            while (resp := await self._call.read()) is not grpc.aio.EOF:
                future, state_ids = self._futures.pop(resp.request_id, (None, None))
                if future is None or future.done():
                    continue
                outcome = _outcome(resp, state_ids)
                if isinstance(outcome, DrafterError):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
        except grpc.RpcError as err:
            failure = from_rpc_error(err)
        self._failure = failure
        for future, _ in self._futures.values():
            if not future.done():
                future.set_exception(failure)
        self._futures.clear()

    async def close(self) -> None:
        if not self._reader.done():
            async with self._write_lock:
                await self._call.done_writing()
        await self._reader

    async def __aenter__(self) -> AsyncProposeStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
