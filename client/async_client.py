"""The asyncio drafter client: ``AsyncDrafterClient``.

Its methods are ``messages``' calls, as ``DrafterClient``'s are, sent on the ``grpc.aio``
stub; every ``grpc.aio.AioRpcError`` is raised as a typed ``DrafterError``. Use it from
one event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

import grpc

from . import messages as m
from .base import Awaiting, ClientBase, client_doc
from .errors import TYPED_ERRORS
from .security import asks_for_security, open_channel
from .stream import AsyncProposeStream
from .tracing import aio_interceptors as tracing_interceptors

R = TypeVar("R")


class AsyncDrafterClient(Awaiting, ClientBase[AsyncProposeStream]):
    __doc__ = client_doc(
        "Asyncio", "AsyncDrafterClient", "Create and use it inside one running event loop."
    )
    _stream_type = AsyncProposeStream

    def _channel_of(self, target, channel, options, tracing, security) -> grpc.aio.Channel:
        if channel is None:
            interceptors = tracing_interceptors() if tracing else None
            return open_channel(grpc.aio, target, options, interceptors, **security)
        if asks_for_security(**security) or tracing:
            raise ValueError(
                "with channel=, put the credentials, token and tracing interceptors in the "
                "channel (mtpdraft.client.tracing.aio_interceptors)"
            )
        return channel

    async def close(self, grace: float | None = None) -> None:
        """Closes the channel if this client opened it."""
        if self._owns_channel:
            await self._channel.close(grace)

    async def __aenter__(self) -> AsyncDrafterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, call: m.Call[R]) -> R:
        if call.streamed:
            return call.parse([answer async for answer in self._answers(call)])
        with TYPED_ERRORS:
            answer = await self._invoke(call)
        return call.parse(answer)

    def _answers(self, call: m.Call[Any]) -> AsyncIterator[Any]:
        answers = self._invoke(call)

        async def read() -> AsyncIterator[Any]:
            with TYPED_ERRORS:
                async for answer in answers:
                    yield answer

        return read()
