"""The hot path: one stream per verifier, one message per verify step.

A ProposeStream carries one state's step a message; a ProposeColumnsStream
(ColumnsStream) a whole verifier step for many states.

Each `propose` sends one ProposeRequest (usually carrying `previous`, the verdict
on the state's last proposal) and returns its answer: one round trip per verify
step. Many states can share one stream and have requests in flight at once
(`submit` returns a future); answers are matched by request id. A bad request
raises its typed error and leaves the stream open. A stream has no deadline unless
opened with one (``client.stream(timeout=...)``, for the whole stream); the client's
default timeout is for its unary calls.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Any

import grpc

from mtpdraft.v1 import drafter_pb2 as pb

from . import messages as m
from .errors import DrafterError, Unavailable, error_from_value, from_rpc_error
from .types import ColumnsResult, Proposal

_CLOSE = object()


def _outcome(resp: pb.ProposeStreamResponse) -> Proposal | DrafterError:
    if resp.HasField("error"):
        return error_from_value(resp.error)
    return m.parse_proposal(resp.proposal)


def _columns_outcome(resp: pb.ColumnsResponse) -> ColumnsResult | DrafterError:
    if resp.HasField("error"):
        return error_from_value(resp.error)
    return m.parse_columns(resp)


def _closed() -> DrafterError:
    return Unavailable(grpc.StatusCode.UNAVAILABLE, "the propose stream is closed")


class ProposeStream:
    """A blocking client's stream. Thread-safe; use as a context manager."""

    _method = "ProposeStream"
    _request, _outcome = staticmethod(m.propose_request), staticmethod(_outcome)

    def __init__(self, stub: Any, timeout: float | None, metadata: m.Metadata = None) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._failure: DrafterError = _closed()  # why the stream ended, once it has
        requests = iter(self._requests.get, _CLOSE)
        self._call = getattr(stub, self._method)(requests, timeout=timeout, metadata=metadata)
        self._reader = threading.Thread(target=self._read, daemon=True, name="propose-stream")
        self._reader.start()

    def submit(self, *args: Any, **kwargs: Any) -> Future[Proposal]:
        """Sends one request (the arguments of `DrafterClient.propose`); returns its future."""
        request = self._request(*args, **kwargs)
        future: Future[Proposal] = Future()
        with self._lock:
            if self._closed:
                raise self._failure
            request.request_id = next(self._ids)
            self._futures[request.request_id] = future
        self._requests.put(request)
        return future

    def propose(self, *args: Any, **kwargs: Any) -> Proposal:
        """One verify step's round trip: the arguments of `DrafterClient.propose`."""
        return self.submit(*args, **kwargs).result()

    def _read(self) -> None:
        failure: DrafterError = _closed()
        try:
            for resp in self._call:
                with self._lock:
                    future = self._futures.pop(resp.request_id, None)
                if future is not None:
                    outcome = self._outcome(resp)
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
        for future in pending.values():
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
    """An asyncio client's stream; use with `async with`."""

    _method = "ProposeStream"
    _request, _outcome = staticmethod(m.propose_request), staticmethod(_outcome)

    def __init__(self, stub: Any, timeout: float | None, metadata: m.Metadata = None) -> None:
        self._call = getattr(stub, self._method)(timeout=timeout, metadata=metadata)
        self._futures: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._failure: DrafterError = _closed()  # why the stream ended, once it has
        self._reader = asyncio.create_task(self._read())

    async def submit(self, *args: Any, **kwargs: Any) -> asyncio.Future[Proposal]:
        """Sends one request (the arguments of `propose`); returns the future of its answer."""
        if self._reader.done():
            raise self._failure
        request = self._request(*args, **kwargs)
        request.request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._futures[request.request_id] = future
        async with self._write_lock:  # one write at a time on a grpc.aio call
            await self._call.write(request)
        return future

    async def propose(self, *args: Any, **kwargs: Any) -> Proposal:
        return await (await self.submit(*args, **kwargs))

    async def _read(self) -> None:
        failure: DrafterError = _closed()
        try:
            while (resp := await self._call.read()) is not grpc.aio.EOF:
                future = self._futures.pop(resp.request_id, None)
                if future is None or future.done():
                    continue
                outcome = self._outcome(resp)
                if isinstance(outcome, DrafterError):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
        except grpc.RpcError as err:
            failure = from_rpc_error(err)
        self._failure = failure
        for future in self._futures.values():
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


class ColumnsStream(ProposeStream):
    """A blocking client's ProposeColumnsStream: one message per verifier step for many
    states (`step` takes the arguments of `DrafterClient.propose_columns`)."""

    _method = "ProposeColumnsStream"
    _request, _outcome = staticmethod(m.columns_request), staticmethod(_columns_outcome)

    def step(self, *args: Any, **kwargs: Any) -> ColumnsResult:
        return self.submit(*args, **kwargs).result()


class AsyncColumnsStream(AsyncProposeStream):
    """An asyncio client's ProposeColumnsStream (see ColumnsStream)."""

    _method = "ProposeColumnsStream"
    _request, _outcome = staticmethod(m.columns_request), staticmethod(_columns_outcome)

    async def step(self, *args: Any, **kwargs: Any) -> ColumnsResult:
        return await (await self.submit(*args, **kwargs))
