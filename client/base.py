"""What the blocking and the asyncio clients share: their options, channel and stub, and
their methods, each one of ``messages``' calls.

A client method is written once, as a ``messages`` function (its arguments, its
docstring, the Call it makes), and named once, here, as a ``Method`` attribute of
``ClientBase`` (``sent``, or ``streamed``). Each client class gets its own function of it,
signed and documented as the call (``help`` and ``inspect.signature`` show the call's
arguments): a coroutine function for an ``Awaiting`` client, a plain one otherwise. The
clients differ only in how they send a Call (``_send``, ``_answers``): on the blocking
stub or the grpc.aio one.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc

from . import messages as m
from .security import PemSource

S = TypeVar("S")  # the client's stream
C = TypeVar("C", bound="ClientBase")
P = ParamSpec("P")
R = TypeVar("R")
B = TypeVar("B")  # a method's answer on a blocking client
A = TypeVar("A")  # and on an Awaiting one

_DOC = """{kind} client of the ``mtpdraft.v1.Drafter`` service.

    ``{name}("localhost:50051")`` opens an insecure channel (with the
    given grpc channel ``options``); pass ``channel=`` to use your own (e.g. a
    secure one), which ``close`` then leaves open.

    TLS: ``root_certificates`` (PEM bytes or a file's path; ``tls=True`` alone trusts
    the system's roots) opens a secure channel, and ``private_key`` with
    ``certificate_chain`` present a client certificate (mutual TLS). ``token`` sends
    ``authorization: Bearer <token>`` on every call, as gRPC call credentials; without
    TLS that is possible only to a loopback address or Unix socket (see
    ``mtpdraft.client.security``). ``options`` may carry e.g.
    ``("grpc.ssl_target_name_override", "localhost")``. ``timeout`` is the default
    deadline in seconds of every unary call and Prefill (None: none); each method's
    ``timeout=`` overrides it, None included. A stream (``stream``) has no deadline
    unless its own ``timeout=`` asks for one: a verifier keeps its stream open for its
    whole life.{loop}

    ``tracing=True`` traces every call: a client span per call, parented by the
    caller's current span, whose context the server's span joins (see
    ``mtpdraft.client.tracing``: where the application set no tracer provider, one is
    made from the standard OTEL_* variables).

    ``affinity_key`` (e.g. the verifier's engine id) goes with every call as the
    ``x-mtpdraft-affinity`` metadata, by which a proxy or gRPC's ring_hash policy sends all
    of a key's calls to one replica (deploy/README.md); ``keyed`` gives a client of the same
    channel with another key.
    """


def client_doc(kind: str, name: str, loop: str = "") -> str:
    """A client class's docstring: ``kind`` ("Blocking"), its ``name``, and what ``loop``
    adds about the event loop."""
    return _DOC.format(kind=kind, name=name, loop=f" {loop}" if loop else "")


class Awaiting:
    """Marks a client whose calls are awaited: its methods are coroutine functions."""


class Method(Generic[P, B, A]):
    """A client method: the Call of ``call`` (a ``messages`` function), sent by the client;
    its answer is ``B`` on a blocking client, ``A`` on an ``Awaiting`` one. Each client
    class holds a function of its own in its place (``ClientBase.__init_subclass__``)."""

    def __init__(self, call: Callable[P, m.Call[Any]], streamed: bool) -> None:
        self.call = call
        self.streamed = streamed  # the answer's messages handed on as they come

    @overload
    def __get__(self, client: None, owner: type) -> Method[P, B, A]: ...
    @overload
    def __get__(self, client: Awaiting, owner: type) -> Callable[P, A]: ...
    @overload
    def __get__(self, client: object, owner: type) -> Callable[P, B]: ...
    def __get__(self, client: object, owner: type) -> Any:
        return self  # on ClientBase itself only: a client class holds the method


def sent(call: Callable[P, m.Call[R]]) -> Method[P, R, Awaitable[R]]:
    """The method that sends ``call``'s Call and returns its answer (awaited, on an
    ``Awaiting`` client)."""
    return Method(call, streamed=False)


def streamed(
    call: Callable[P, m.Call[Any]],
) -> Method[P, Iterator[pb.KVChunk], AsyncIterator[pb.KVChunk]]:
    """The method that sends ``call``'s Call and returns its answer's messages as they come
    (an async iterator, on an ``Awaiting`` client)."""
    return Method(call, streamed=True)


class ClientBase(Generic[S]):
    """A client's channel, stub, default deadline and affinity key. A subclass says how its
    channel is made (``_channel_of``) and how a Call is sent."""

    _stream_type: Callable[..., S]  # ProposeStream or AsyncProposeStream

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, made in vars(ClientBase).items():
            # Not where the class (or a client class above it) holds a method already.
            if isinstance(made, Method) and isinstance(getattr(cls, name), Method):
                setattr(cls, name, _method(cls, name, made))

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        channel: Any = None,
        tls: bool = False,
        root_certificates: PemSource | None = None,
        private_key: PemSource | None = None,
        certificate_chain: PemSource | None = None,
        token: str | None = None,
        tracing: bool = False,
        affinity_key: str | None = None,
    ) -> None:
        security = dict(
            tls=tls,
            root_certificates=root_certificates,
            private_key=private_key,
            certificate_chain=certificate_chain,
            token=token,
        )
        if channel is None and target is None:
            raise ValueError("give a target or a channel")
        self._owns_channel = channel is None
        self._channel = self._channel_of(target, channel, options, tracing, security)
        self.target = target
        self.timeout = timeout
        self.affinity_key = affinity_key
        self._metadata = m.affinity_metadata(affinity_key)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)

    def _channel_of(
        self,
        target: str | None,
        channel: Any,
        options: Sequence[tuple[str, Any]] | None,
        tracing: bool,
        security: dict[str, Any],
    ) -> Any:
        """The channel to use: ``channel``, or one opened to ``target``; ``security``: the
        keywords of ``security.channel_credentials``."""
        raise NotImplementedError

    def _send(self, call: m.Call[Any]) -> Any:
        """Sends ``call``; its answer as ``call.parse`` reads it (or an awaitable of it)."""
        raise NotImplementedError

    def _answers(self, call: m.Call[Any]) -> Any:
        """Sends ``call``; the messages of its streamed answer, as they come."""
        raise NotImplementedError

    def keyed(self: C, affinity_key: str | None) -> C:
        """A client of this channel whose calls carry ``affinity_key`` (closing it leaves
        the channel open)."""
        client = type(self)(channel=self._channel, timeout=self.timeout, affinity_key=affinity_key)
        client.target = self.target
        return client

    @property
    def channel(self) -> Any:
        return self._channel

    def stream(self, *, timeout: float | None = None) -> S:
        """The hot path: a ProposeStream, one message and one answer per verify step
        (``step`` takes the arguments of ``propose_batch``; ``propose`` those of
        ``propose``, a batch of one). No deadline unless ``timeout`` (seconds, for the
        whole stream) is given: the client's default timeout is not applied."""
        return self._stream_type(self._stub, timeout, self._metadata)

    def _invoke(self, call: m.Call[Any]) -> Any:
        """The stub's call of ``call``: its answer, or what the stub gives for it."""
        rpc = getattr(self._stub, call.rpc)
        timeout = m.resolve_timeout(call.timeout, self.timeout)
        return rpc(call.request, timeout=timeout, metadata=self._metadata)

    info = sent(m.info)
    alloc_state = sent(m.alloc_state)
    prefill = sent(m.prefill)
    propose = sent(m.propose)
    propose_batch = sent(m.propose_batch)
    propose_many = sent(m.propose_many)
    after_verify = sent(m.after_verify)
    take_kv = sent(m.take_kv)
    install_kv = sent(m.install_kv)
    export_kv_chunks = streamed(m.export_kv_chunks)
    export_kv = sent(m.export_kv)
    import_kv = sent(m.import_kv)
    free_state = sent(m.free_state)


def _method(cls: type, name: str, made: Method[Any, Any, Any]) -> Callable[..., Any]:
    """Client class ``cls``'s method ``name``: ``made``'s call, sent by ``cls``; named,
    documented and signed as the call (``self`` first), returning what the client gives."""
    call = made.call
    signature = inspect.signature(call)
    returns = signature.return_annotation.removeprefix("Call[").removesuffix("]")  # as text
    awaiting = issubclass(cls, Awaiting)
    if made.streamed:
        returns = "AsyncIterator[pb.KVChunk]" if awaiting else "Iterator[pb.KVChunk]"

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._answers(call(*args, **kwargs))

    elif awaiting:

        async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await self._send(call(*args, **kwargs))

    else:

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._send(call(*args, **kwargs))

    self_ = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self_, *signature.parameters.values()], return_annotation=returns
    )
    method.__name__, method.__qualname__ = name, f"{cls.__name__}.{name}"
    method.__module__, method.__doc__ = cls.__module__, call.__doc__
    return method
