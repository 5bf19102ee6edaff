"""The blocking drafter client: ``DrafterClient``.

Its methods are ``messages``' calls, sent on the blocking stub; every ``grpc.RpcError``
is raised as a typed ``DrafterError``. Thread-safe (one channel, shared by all calls).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from . import messages as m
from .base import ClientBase, client_doc
from .errors import TYPED_ERRORS
from .security import asks_for_security, open_channel
from .stream import ProposeStream
from .tracing import traced_channel

R = TypeVar("R")


class DrafterClient(ClientBase[ProposeStream]):
    __doc__ = client_doc("Blocking", "DrafterClient")
    _stream_type = ProposeStream

    def _channel_of(self, target, channel, options, tracing, security) -> grpc.Channel:
        if channel is None:
            channel = open_channel(grpc, target, options, **security)
        elif asks_for_security(**security):
            raise ValueError("with channel=, put the credentials and token in the channel")
        # Closing a traced channel closes the channel under it.
        return traced_channel(channel) if tracing else channel

    def close(self) -> None:
        """Closes the channel if this client opened it."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> DrafterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, call: m.Call[R]) -> R:
        if call.streamed:
            return call.parse(list(self._answers(call)))
        if not isinstance(call.request, Message) and isinstance(call.request, AsyncIterator):
            raise TypeError(f"{call.rpc}: a blocking client sends an iterable, not an async one")
        with TYPED_ERRORS:
            answer = self._invoke(call)
        return call.parse(answer)

    def _answers(self, call: m.Call[Any]) -> Iterator[Any]:
        answers = self._invoke(call)

        def read() -> Iterator[Any]:
            with TYPED_ERRORS:
                yield from answers

        return read()
